"""One request's KV and the only code that changes it: its row of the request table, the pool pages it reads, the
cached prefix those pages start with, and a load of more prefix pages from the tiers below the pool.

The scheduler decides when (admit, grow, trim, roll back, release); this says how, so that a page changes hands in
one class. Every operation is given the cache manager (and the request table where a row changes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.cache import PrefixMatch
from engine.pages import pages_for

if TYPE_CHECKING:
    from engine.kv.cache import CacheManager
    from engine.kv.table import RequestTable
    from engine.kv.tiers import Below, KVLoad


@dataclass(eq=False)
class RequestKV:
    """Invariant while admitted: `pages[i]` holds positions [i * page_size, (i + 1) * page_size), the first
    `len(prefix.pages)` of them the cache's (locked for this request, or handed back early past a sliding window),
    the rest this request's own; the request table's row `slot` lists the same pages."""

    slot: int | None = None  # its row of the request table while admitted
    pages: list[int] = field(default_factory=list)  # the pool pages it reads, in position order
    prefix: PrefixMatch = field(default_factory=PrefixMatch)  # the cache's pages `pages` starts with
    loading: KVLoad | None = None  # its prefix's pages on their way up from the tiers, until it is admitted
    cached_tokens: int = 0  # prompt tokens its first admission found cached (usage reports them), of which
    host_tokens: int = 0  # ... came up from host memory
    disk_tokens: int = 0  # ... and from disk

    @property
    def waits_for_load(self) -> bool:
        """Its prefix's pages are still on their way up from the tiers below the pool."""
        return self.loading is not None and not self.loading.done

    def admit(self, cache: CacheManager, table: RequestTable, owner: str, match: PrefixMatch, first: bool) -> int:
        """Take a request-table row and the pages of `match` (locked by the caller), which covers what a load brought
        up: the load's own hold on them ends. `first`: its first admission, whose cached tokens usage reports.
        Returns the tokens the match covers."""
        page_size = cache.page_size
        if self.loading is not None:
            if first:
                self.host_tokens = self.loading.from_tier("host") * page_size
                self.disk_tokens = self.loading.from_tier("disk") * page_size
            self.drop_load(cache)
        self.prefix, self.pages = match, list(match.pages)
        self.slot = table.allocate(owner)
        table.write_pages(self.slot, 0, self.pages, page_size)
        cached = len(match.pages) * page_size
        if first:
            self.cached_tokens = cached
        return cached

    def grow(self, cache: CacheManager, table: RequestTable, owner: str, tokens: int) -> None:
        """Pages for positions up to `tokens` (room was made for them: this cannot fail)."""
        need = pages_for(tokens, cache.page_size) - len(self.pages)
        if need <= 0:
            return
        assert self.slot is not None, "only an admitted request grows"
        new = cache.allocate(need, owner)
        table.write_pages(self.slot, len(self.pages), new, cache.page_size)
        self.pages += new

    def trim_front(self, cache: CacheManager, passed: int, tokens: Callable[[int, int], list[int]]) -> None:
        """Give the cache the first `passed` pages (every layer's window has gone past them) beyond those the prefix
        covers already; they keep their places in `pages`, covered by the prefix now. `tokens(start, end)`: the
        request's token ids, read only when there are pages to give (a step's usual case is none)."""
        if passed > len(self.prefix.pages):
            self.prefix = cache.release_front(tokens(0, passed * cache.page_size), self.pages, self.prefix)

    def truncate(self, cache: CacheManager, tokens: int) -> None:
        """Free the pages past position `tokens` (they held only rejected speculative positions)."""
        keep = pages_for(tokens, cache.page_size)
        if len(self.pages) > keep:
            cache.free(self.pages[keep:])
            del self.pages[keep:]

    def share(self, cache: CacheManager, prompt: list[int]) -> None:
        """Offer its full pages of `prompt` to other requests now (a group's choices share the prompt this way)."""
        self.prefix = cache.share(prompt, self.pages, self.prefix)

    def start_load(self, cache: CacheManager, owner: str, tokens: list[int], match: PrefixMatch,
                   below: Below) -> None:
        """Bring `below`'s pages (of `tokens`, past `match`) up from the tiers."""
        self.loading = cache.load(owner, tokens, match, below)

    def drop_load(self, cache: CacheManager) -> None:
        """Give back what a load holds for it (its pages, or the hold on loaded ones)."""
        if self.loading is not None:
            cache.cancel_load(self.loading)
            self.loading = None

    def check(self, table: RequestTable, page_size: int, cached_len: int) -> None:
        """Raise AssertionError unless the invariant holds for a request with no batch in flight whose K/V is
        written up to `cached_len`: just the pages that holds, the prefix's first, listed in its table row."""
        if self.slot is None:
            assert not self.pages and not self.prefix.pages, "a request without a slot holds pages"
            return
        assert len(self.pages) == pages_for(cached_len, page_size), \
            f"{len(self.pages)} pages for {cached_len} tokens of {page_size}"
        assert self.pages[: len(self.prefix.pages)] == self.prefix.pages or self.prefix.handed, \
            "the cached prefix is not where the pages start"
        rows = table.table[self.slot, : len(self.pages) * page_size : page_size].tolist()
        assert rows == [p * page_size for p in self.pages][: len(rows)], "the table row lists other pages"

    def release(self, cache: CacheManager, table: RequestTable, written: list[int]) -> None:
        """Hold nothing any more: the row back to the table, the pages to the cache, which keeps what it can of
        `written` (the tokens whose K/V the pages hold)."""
        self.drop_load(cache)
        if self.slot is None:  # never admitted: it held nothing else
            return
        table.free(self.slot)
        self.slot = None
        cache.release(written, self.pages, self.prefix)
        self.pages, self.prefix = [], PrefixMatch()
