"""Radix prefix cache at page granularity: finished requests leave their full pages behind as a tree
keyed by token content, and a new prompt that starts the same way reuses them instead of recomputing.

Each node holds one page (`page_size` tokens). A request locks the path it matched, which pins
every page on it; eviction takes least-recently-used unlocked leaves first, so a prefix outlives the
longer continuations that share it.

Sliding windows: a running request of a model whose every layer attends within a window hands the pages the
window has passed to the tree early (`release_front`), unlocked, so they are evictable while it runs. The tree
stays a tree of whole prefixes (a node's page holds its tokens' K/V in every layer, and eviction takes leaves
only), so any match is a complete prefix and its window intact. The request's later pages join under the path of
the tokens it handed over if that path is still there when they are inserted (another request's pages for the same
tokens serve as well); if it was evicted meanwhile, they are freed instead.
"""

from __future__ import annotations

import heapq
import itertools

from engine.kv.allocator import PageAllocator
from engine.kv.cache import CacheManager, PrefixMatch


class Node:
    __slots__ = ("children", "key", "last_access", "lock_ref", "page", "parent")

    def __init__(self, parent: Node | None, key: tuple[int, ...], page: int) -> None:
        self.parent = parent
        self.key = key
        self.page = page
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = 0


class RadixCacheManager(CacheManager):
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        super().__init__(allocator, page_size)
        self.root = Node(None, (), -1)
        self.root.lock_ref = 1  # never evicted
        self.by_page: dict[int, Node] = {}
        self._clock = itertools.count(1)
        self._locked = 0

    def _pages_of(self, token_ids: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(token_ids[i : i + ps]) for i in range(0, len(token_ids) - ps + 1, ps)]

    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        node, pages, now = self.root, [], next(self._clock)
        for key in self._pages_of(token_ids):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            node.last_access = now
            pages.append(node.page)
        return PrefixMatch(handle=node if pages else None, pages=pages)

    def lock(self, handle: object) -> None:
        node = handle
        while isinstance(node, Node) and node is not self.root:
            if node.lock_ref == 0:
                self._locked += 1
                self.allocator.mark([node.page])
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: object) -> None:
        node = handle
        while isinstance(node, Node) and node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked -= 1
                self.allocator.mark([node.page])
            node = node.parent

    def _insert(self, keys: list[tuple[int, ...]], pages: list[int],
                match: PrefixMatch) -> tuple[Node | None, list[int], list[int]]:
        """Put a request's full pages along `keys` in the tree (ours become the cache's where the path is new); the
        last node, the tree's pages along the path, and ours that duplicate pages cached first by someone else. The
        first `match.handed` pages are no longer the request's: their tokens' path must still be there (None, and
        nothing inserted, if it was evicted)."""
        node, now = self.root, next(self._clock)
        path: list[int] = []
        duplicates: list[int] = []
        for i, (key, page) in enumerate(zip(keys, pages, strict=False)):
            child = node.children.get(key)
            if i < match.handed:
                if child is None:
                    return None, [], []
            elif child is None:
                child = Node(node, key, page)
                node.children[key] = child
                self.by_page[page] = child
                self.allocator.disown([page])
            elif child.page != page:
                duplicates.append(page)
            child.last_access = now
            node = child
            path.append(node.page)
        return node, path, duplicates

    def release(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> None:
        """Insert the request's full pages (its matched prefix is already there), free the rest; everything it owns
        if the path of the pages it handed over early was evicted."""
        keys = self._pages_of(token_ids)
        node, _, duplicates = self._insert(keys, pages, match)
        if node is None:
            self.allocator.free(pages[len(match.pages) :])
        else:
            self.allocator.free(duplicates + pages[max(len(keys), len(match.pages)) :])  # and the partly filled tail
        self.unlock(match.handle)

    def release_front(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> PrefixMatch:
        """Insert the passed pages unlocked (evictable at once); ours that duplicate cached ones are freed."""
        keys = self._pages_of(token_ids)
        node, _, duplicates = self._insert(keys, pages, match)
        self.allocator.free(pages[len(match.pages) : len(keys)] if node is None else duplicates)
        self.unlock(match.handle)
        return PrefixMatch(pages=pages[: len(keys)], handed=len(keys))

    def share(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> PrefixMatch:
        """Put the request's full pages in the tree and lock the whole path. Where the tokens are cached
        already the tree's page stays, and ours stays the request's until release frees it as a duplicate."""
        node, path, _ = self._insert(self._pages_of(token_ids), pages, match)
        if node is None or not path:
            return match
        self.lock(node)
        self.unlock(match.handle)
        return PrefixMatch(handle=node, pages=path, handed=match.handed)

    def evict(self, num_pages: int) -> int:
        leaves = [(n.last_access, n.page, n) for n in self.by_page.values() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < num_pages:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None  # only the root has no parent, and it is never in by_page
            del parent.children[node.key]
            del self.by_page[node.page]
            self.allocator.reclaim([node.page])
            freed += 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, parent.page, parent))
        return freed

    def cached_pages(self) -> dict[int, bool]:
        return {page: node.lock_ref > 0 for page, node in self.by_page.items()}

    def cached_lock(self, page: int) -> bool | None:
        node = self.by_page.get(page)
        return None if node is None else node.lock_ref > 0

    @property
    def evictable_size(self) -> int:
        # A locked node locks its ancestors too, so every unlocked node can be reached by leaf eviction.
        return len(self.by_page) - self._locked
