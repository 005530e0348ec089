"""Radix prefix cache at page granularity: finished requests leave their full pages behind as a tree
keyed by token content, and a new prompt that starts the same way reuses them instead of recomputing.

Each node holds one page (`page_size` tokens). A request locks the path it matched, which pins
every page on it; eviction takes least-recently-used unlocked leaves first, so a prefix outlives the
longer continuations that share it.
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

    def _insert(self, keys: list[tuple[int, ...]], pages: list[int]) -> tuple[Node, list[int], list[int]]:
        """Put full pages along `keys` in the tree (ours become the cache's where the path is new); the last
        node, the tree's pages along the path, and ours that duplicate pages cached first by someone else."""
        node, now = self.root, next(self._clock)
        path: list[int] = []
        duplicates: list[int] = []
        for key, page in zip(keys, pages, strict=False):
            child = node.children.get(key)
            if child is None:
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
        """Insert the request's full pages (its matched prefix is already there), free the rest."""
        keys = self._pages_of(token_ids)
        _, _, duplicates = self._insert(keys, pages)
        self.allocator.free(duplicates + pages[len(keys) :])  # and the partly filled tail page
        self.unlock(match.handle)

    def share(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> PrefixMatch:
        """Put the request's full pages in the tree and lock the whole path. Where the tokens are cached
        already the tree's page stays, and ours stays the request's until release frees it as a duplicate."""
        node, path, _ = self._insert(self._pages_of(token_ids), pages)
        if not path:
            return match
        self.lock(node)
        self.unlock(match.handle)
        return PrefixMatch(handle=node, pages=path)

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
