"""NaiveCacheManager: no prefix reuse; finished requests' pages go straight back to the free list."""

from __future__ import annotations

from engine.kv.cache import CacheManager, PrefixMatch


class NaiveCacheManager(CacheManager):
    """No prefix reuse: nothing is ever cached, a finished request's pages go straight back."""

    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        return PrefixMatch()

    def lock(self, handle: object) -> None:
        pass

    def unlock(self, handle: object) -> None:
        pass

    def release(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> None:
        self.allocator.free(pages[len(match.pages) :])

    def release_front(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> PrefixMatch:
        passed = len(token_ids) // self.page_size
        self.allocator.free(pages[len(match.pages) : passed])
        return PrefixMatch(pages=pages[:passed], handed=passed)

    def evict(self, num_pages: int) -> int:
        return 0

    def cached_pages(self) -> dict[int, bool]:
        return {}

    def cached_lock(self, page: int) -> bool | None:
        return None

    @property
    def evictable_size(self) -> int:
        return 0
