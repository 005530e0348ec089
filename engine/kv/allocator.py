"""Page allocator: hands out KV pages and remembers which request holds each one."""

from __future__ import annotations


class PageAllocator:
    """A free list of page ids plus an owner map, so stats can colour every page.

    Pages come back in LIFO order: a page freed a moment ago is likely still warm in cache.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, owner: str) -> list[int]:
        """Take `n` free pages for `owner`; the caller makes room first (see CacheManager.allocate)."""
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.owner[p] = owner
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            del self.owner[p]
            self._free.append(p)

    def reclaim(self, pages: list[int]) -> None:
        """Return pages evicted from the prefix cache (they had no request owner) to the free list."""
        self._free.extend(pages)

    def disown(self, pages: list[int]) -> None:
        """Forget the owner of pages that move into the prefix cache (they stay allocated)."""
        for p in pages:
            del self.owner[p]

    def free_pages(self) -> set[int]:
        return set(self._free)
