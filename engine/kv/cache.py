"""Cache-manager interface: what the scheduler asks of KV memory, whatever the reuse policy.

The scheduler never touches the page allocator directly. It asks the cache manager to match a
prompt prefix, lock what it matched while the request runs, allocate fresh pages (evicting cached
ones when the free list runs dry) and, at cleanup, take the request's pages back. A prefix-reusing
policy (radix tree) plugs in behind the same methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from engine.kv.allocator import PageAllocator


@dataclass
class PrefixMatch:
    """A page-aligned cached prefix: `pages` hold the first `len(pages) * page_size` prompt tokens."""

    handle: object = None
    pages: list[int] = field(default_factory=list)


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
        """Pages a new request could get: free plus evictable (the seed's `available_size`, in pages)."""
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

    def check_integrity(self) -> None:
        """Every page is exactly one of free, held by a request, or cached; raise if not."""
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
