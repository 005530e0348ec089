"""Page allocator: hands out KV pages and remembers which request holds each one."""

from __future__ import annotations


class PageAllocator:
    """A free list of page ids plus an owner map, so stats can colour every page.

    Pages come back in LIFO order: a page freed a moment ago is likely still warm in cache. Once the
    stats keep a page map (engine/pages.py), `moved` collects the pages whose state may have changed
    (taken, freed, cached, evicted; the cache adds those it locks or unlocks), so bringing the map up to
    date costs what moved, not the pool size; it is None until then.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.owner: dict[int, str] = {}
        self.moved: set[int] | None = None

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
        self.mark(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            del self.owner[p]
            self._free.append(p)
        self.mark(pages)

    def reclaim(self, pages: list[int]) -> None:
        """Return pages evicted from the prefix cache (they had no request owner) to the free list."""
        self._free.extend(pages)
        self.mark(pages)

    def disown(self, pages: list[int]) -> None:
        """Forget the owner of pages that move into the prefix cache (they stay allocated)."""
        for p in pages:
            del self.owner[p]
        self.mark(pages)

    def mark(self, pages: list[int]) -> None:
        """Note pages whose state may have changed, for the page map (see the class docstring)."""
        if self.moved is not None:
            self.moved.update(pages)

    def free_pages(self) -> set[int]:
        return set(self._free)
