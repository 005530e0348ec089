"""Cache-manager interface: what the scheduler asks of KV memory, whatever the reuse policy.

The scheduler never touches the page allocator directly. It asks the cache manager to match a
prompt prefix, lock what it matched while the request runs, allocate fresh pages (evicting cached
ones when the free list runs dry) and, at cleanup, take the request's pages back. A prefix-reusing
policy (radix tree) plugs in behind the same methods. A model whose every layer attends within a sliding
window gives back a running request's pages as the window passes them (`release_front`), so a long chat holds
only about a window of pages. Below the pool there may be tiers (host memory, disk: engine/kv/tiers.py): a match
then extends into them (`find_below`), and a waiting request's pages found there are loaded back (`load`,
`poll_loads`) before it is admitted; without tiers these do nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from engine.kv.allocator import PageAllocator
from engine.kv.tiers import Below, KVLoad
from engine.pages import TierUse


@dataclass
class PrefixMatch:
    """A request's leading pages that are the cache's, not its own: a page-aligned cached prefix (`pages` hold the
    first `len(pages) * page_size` tokens), locked through `handle` while the request runs. The first `handed` of
    them are pages the request gave back early (`release_front`): unlocked, perhaps evicted since."""

    handle: object = None
    pages: list[int] = field(default_factory=list)
    handed: int = 0


class CacheManager(ABC):
    """Owns the page allocator; subclasses decide what survives a finished request."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        """Longest cached page-aligned prefix of `token_ids`."""

    @abstractmethod
    def lock(self, handle: object) -> None:
        """Pin a matched prefix so eviction cannot take it while a request reads it."""

    @abstractmethod
    def unlock(self, handle: object) -> None:
        """Undo `lock`."""

    @abstractmethod
    def release(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> None:
        """Take back a finished request's pages: `pages[i]` holds tokens [i*page_size, (i+1)*page_size)
        of `token_ids` (the tokens whose K/V were written). The request's own lock is released here."""

    @abstractmethod
    def release_front(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> PrefixMatch:
        """Take back the first `len(token_ids) // page_size` pages of a running request that will never read them
        again (every layer's sliding window has passed them), more than `match` covers: `pages[i]` holds tokens
        [i*page_size, (i+1)*page_size) of `token_ids`. Returns the match the request holds instead, covering them
        (`handed`): the request keeps their places in its page list but no longer owns them."""

    def share(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> PrefixMatch:
        """Offer a running request's full pages of `token_ids` to other requests now, not at its release
        (a group's choices share their prompt this way); returns the match the request holds instead of
        `match`. Without prefix reuse there is nothing to share."""
        return match

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unlocked cached pages; returns how many were freed."""

    @abstractmethod
    def cached_pages(self) -> dict[int, bool]:
        """Every page held by the cache, mapped to whether it is locked."""

    @abstractmethod
    def cached_lock(self, page: int) -> bool | None:
        """Whether the cache holds `page` locked (True) or unlocked (False); None if it does not hold it.
        The cache marks a page on the allocator (`PageAllocator.mark`) when this changes without the
        allocator's doing: when a lock starts or ends."""

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Cached pages that eviction could free right now."""

    @property
    def available_size(self) -> int:
        """Pages a new request could get: free plus evictable (in pages)."""
        return self.allocator.num_free + self.evictable_size

    def free(self, pages: list[int]) -> None:
        """Take back pages a running request no longer needs: they held only positions it wrote
        speculatively, which verification rejected (never cached: no one else can have matched them)."""
        self.allocator.free(pages)

    def allocate(self, n: int, owner: str) -> list[int]:
        """Fresh pages for `owner`, evicting cached pages first if the free list is short."""
        short = n - self.allocator.num_free
        if short > 0:
            self.evict(short)
        return self.allocator.allocate(n, owner)

    # -- tiers below the pool (none here: see RadixCacheManager) ---------------------------------
    def find_below(self, token_ids: list[int], match: PrefixMatch) -> Below:
        """The full pages of `token_ids` past `match` that tiers below the pool hold, up to the first they do not."""
        return Below()

    def load(self, owner: str, token_ids: list[int], match: PrefixMatch, below: Below) -> KVLoad:
        """Start bringing `below`'s pages into pool pages of `owner`'s (`match` stays locked meanwhile); the load is
        `done` at once if nothing had to be read from disk, else when `poll_loads` returns it."""
        raise NotImplementedError("no tiers below the pool")

    def poll_loads(self) -> list[KVLoad]:
        """The loads whose pages are now in the tree, locked for their owner (`KVLoad.pin`)."""
        return []

    def cancel_load(self, load: KVLoad) -> None:  # noqa: B027 - a hook, a no-op without tiers
        """The owner is gone: free what its load holds (its pages, or the pin of a finished one)."""

    def wait_loads(self, timeout: float) -> None:  # noqa: B027 - a hook, a no-op without tiers
        """Wait up to `timeout` seconds for a load's read to arrive (when there is nothing else to do)."""

    @property
    def loading(self) -> bool:
        """A load is under way."""
        return False

    def scheduling(self, batch: int) -> None:  # noqa: B027 - a hook, a no-op without tiers
        """The scheduler is building its `batch`-th batch: pages handed over or shared now may still be written
        by it or the one before."""

    def processed(self, batches: int) -> None:  # noqa: B027 - a hook, a no-op without tiers
        """The first `batches` batches are processed: what they wrote is final."""

    def tier_use(self) -> list[TierUse]:
        """The tiers below the pool and what they did."""
        return []

    @property
    def unstaged(self) -> bool:
        """Final pages wait to be written down (the staging ring had no room, or their batch was not processed
        when the engine went idle): the idle loop calls `processed` until none do."""
        return False

    def flush(self, timeout: float = 60.0) -> bool:
        """At idle: write every cached page down and wait for the writes; False if that took over `timeout` s."""
        return True

    def close(self) -> None:  # noqa: B027 - a hook, a no-op without tiers
        """Finish the tiers' writes and stop their threads."""

    def check_integrity(self, idle: bool = False) -> None:
        """Every page is exactly one of free, held by a request, or cached (and, `idle`, nothing loads); raise if
        not."""
        free = self.allocator.free_pages()
        used = set(self.allocator.owner)
        cached = set(self.cached_pages())
        total = self.allocator.num_pages
        if len(free) != self.allocator.num_free:
            raise AssertionError("a page appears twice on the free list")
        if free & used or free & cached or used & cached:
            raise AssertionError(f"pages in two states: free&used={sorted(free & used)} "
                                 f"free&cached={sorted(free & cached)} used&cached={sorted(used & cached)}")
        if len(free) + len(used) + len(cached) != total:
            raise AssertionError(f"free {len(free)} + used {len(used)} + cached {len(cached)} != total {total}")
