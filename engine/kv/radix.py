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

Tiers (engine/kv/tiers.py), when the engine has them: each node keeps its page's chain key (`Node.hash`). A node's
page is written through to the disk tier once it is final: at its request's release, or, for pages handed over
early or shared while a batch may still write them, once the scheduler says that batch is processed
(`scheduling` / `processed`). Evicted pages move down to the host tier. `find_below` extends a match with pages
found below the pool, `load` brings them up for a waiting request (its pool pages owned by it meanwhile), and
once they are in, `poll_loads` adds them to the tree, locked for that request (`KVLoad.pin`) until it is admitted.
"""

from __future__ import annotations

import heapq
import itertools
import time

from engine.kv.allocator import PageAllocator
from engine.kv.cache import CacheManager, PrefixMatch
from engine.kv.tiers import Below, KVLoad, KVTiers, Stored
from engine.pages import TierUse


class Node:
    __slots__ = ("children", "hash", "key", "last_access", "lock_ref", "page", "parent", "stored")

    def __init__(self, parent: Node | None, key: tuple[int, ...], page: int, hash: bytes = b"") -> None:
        self.parent = parent
        self.key = key
        self.page = page
        self.hash = hash  # the page's chain key (with tiers; engine/kv/tiers.py)
        self.stored = False  # written (or queued) to the disk tier
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = 0

    def stored_as(self) -> Stored:
        assert self.parent is not None
        return Stored(self.page, self.hash, self.parent.hash, self.key)


class RadixCacheManager(CacheManager):
    def __init__(self, allocator: PageAllocator, page_size: int, tiers: KVTiers | None = None) -> None:
        super().__init__(allocator, page_size)
        self.tiers = tiers
        self.root = Node(None, (), -1, tiers.root if tiers is not None else b"")
        self.root.lock_ref = 1  # never evicted
        self.by_page: dict[int, Node] = {}
        self._clock = itertools.count(1)
        self._locked = 0
        self._batch = 0  # the batch being scheduled (`scheduling`)
        self._pending: dict[Node, int] = {}  # nodes whose page is final once this batch is processed
        self._unstaged: dict[Node, None] = {}  # final, not written yet: the staging ring was full (in order)

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
                match: PrefixMatch) -> tuple[Node | None, list[Node], list[int]]:
        """Put a request's full pages along `keys` in the tree (ours become the cache's where the path is new); the
        last node, the tree's nodes along the path, and our pages that duplicate pages cached first by someone else.
        The first `match.handed` pages are no longer the request's: their tokens' path must still be there (None,
        and nothing inserted, if it was evicted)."""
        node, now = self.root, next(self._clock)
        path: list[Node] = []
        duplicates: list[int] = []
        for i, (key, page) in enumerate(zip(keys, pages, strict=False)):
            child = node.children.get(key)
            if i < match.handed:
                if child is None:
                    return None, [], []
            elif child is None:
                child = Node(node, key, page, self.tiers.key(node.hash, key) if self.tiers is not None else b"")
                node.children[key] = child
                self.by_page[page] = child
                self.allocator.disown([page])
            elif child.page != page:
                duplicates.append(page)
            child.last_access = now
            node = child
            path.append(node)
        return node, path, duplicates

    def release(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> None:
        """Insert the request's full pages (its matched prefix is already there), free the rest; everything it owns
        if the path of the pages it handed over early was evicted. Its pages are final: written through to disk."""
        keys = self._pages_of(token_ids)
        node, path, duplicates = self._insert(keys, pages, match)
        if node is None:
            self._store_chain(keys, pages, match.handed)
            self.allocator.free(pages[len(match.pages) :])
        else:
            self._store(path)
            self.allocator.free(duplicates + pages[max(len(keys), len(match.pages)) :])  # and the partly filled tail
        self.unlock(match.handle)

    def release_front(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> PrefixMatch:
        """Insert the passed pages unlocked (evictable at once); ours that duplicate cached ones are freed."""
        keys = self._pages_of(token_ids)
        node, path, duplicates = self._insert(keys, pages, match)
        self.allocator.free(pages[len(match.pages) : len(keys)] if node is None else duplicates)
        self._store_later(path)
        self.unlock(match.handle)
        return PrefixMatch(pages=pages[: len(keys)], handed=len(keys))

    def share(self, token_ids: list[int], pages: list[int], match: PrefixMatch) -> PrefixMatch:
        """Put the request's full pages in the tree and lock the whole path. Where the tokens are cached
        already the tree's page stays, and ours stays the request's until release frees it as a duplicate."""
        node, path, _ = self._insert(self._pages_of(token_ids), pages, match)
        if node is None or not path:
            return match
        self._store_later(path)
        self.lock(node)
        self.unlock(match.handle)
        return PrefixMatch(handle=node, pages=[n.page for n in path], handed=match.handed)

    def evict(self, num_pages: int) -> int:
        leaves = [(n.last_access, n.page, n) for n in self.by_page.values() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        evicted: list[Node] = []
        while leaves and len(evicted) < num_pages:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None  # only the root has no parent, and it is never in by_page
            del parent.children[node.key]
            del self.by_page[node.page]
            evicted.append(node)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, parent.page, parent))
        if self.tiers is not None:  # down a tier, before the pages are the pool's again (a page still written: not)
            final = [n for n in evicted if self._pending.pop(n, None) is None]
            self.tiers.demote([n.stored_as() for n in final])
            self._store(final)
            for node in evicted:  # no room to stage them now: too late to try again
                self._unstaged.pop(node, None)
        self.allocator.reclaim([n.page for n in evicted])
        return len(evicted)

    # -- tiers ------------------------------------------------------------------------------------
    def _store(self, nodes: list[Node]) -> None:
        """Write through the final pages of `nodes` not written yet; those the staging ring has no room for now are
        tried again after the next step (`_unstaged`)."""
        if self.tiers is None:
            return
        fresh = [n for n in nodes if not n.stored]
        for node, stored in zip(fresh, self.tiers.store([n.stored_as() for n in fresh]), strict=True):
            self._pending.pop(node, None)
            if stored is None:
                self._unstaged[node] = None
            else:
                node.stored = stored
                self._unstaged.pop(node, None)

    def _store_later(self, nodes: list[Node]) -> None:
        """Write these through once the batch being scheduled is processed (it, or the one before, may write them)."""
        if self.tiers is not None:
            for node in nodes:
                if not node.stored:
                    self._pending[node] = self._batch

    def _store_chain(self, keys: list[tuple[int, ...]], pages: list[int], start: int) -> None:
        """Write through a released request's own pages (from `start`) that the tree no longer has a path for: the
        disk may still have the path (its pages were written before they were evicted)."""
        if self.tiers is None or start >= len(keys):
            return
        parent, stored = self.root.hash, []
        for i, key in enumerate(keys):
            node_key = self.tiers.key(parent, key)
            if i >= start:
                stored.append(Stored(pages[i], node_key, parent, key))
            parent = node_key
        self.tiers.store(stored)

    def scheduling(self, batch: int) -> None:
        self._batch = batch

    def processed(self, batches: int) -> None:
        due = [*self._unstaged, *(n for n, batch in self._pending.items() if batch <= batches)]
        for node in due:
            self._pending.pop(node, None)
        self._unstaged.clear()
        self._store([n for n in due if self.by_page.get(n.page) is n])

    def find_below(self, token_ids: list[int], match: PrefixMatch) -> Below:
        if self.tiers is None:
            return Below()
        handle = match.handle
        parent = handle.hash if isinstance(handle, Node) else self.root.hash
        return self.tiers.find(parent, self._pages_of(token_ids)[len(match.pages) :])

    def load(self, owner: str, token_ids: list[int], match: PrefixMatch, below: Below) -> KVLoad:
        assert self.tiers is not None and below.pages
        self.lock(match.handle)
        pages = self.allocate(len(below.pages), owner)
        end = (len(match.pages) + len(below.pages)) * self.page_size
        load = KVLoad(owner, token_ids[:end], match.handle, list(match.pages), below.pages, pages)
        self.tiers.start(load)
        if load.complete:  # all from the host tier: copied in already
            self._finish(load)
        return load

    def poll_loads(self) -> list[KVLoad]:
        if self.tiers is None:
            return []
        done = self.tiers.collect()
        for load in done:
            self._finish(load)
        return done

    def _finish(self, load: KVLoad) -> None:
        """The loaded pages (up to the first that failed) join the tree under the prefix they extend, locked for
        the request (`pin`); pages past a failure, and ours that duplicate pages cached meanwhile, are freed."""
        assert self.tiers is not None
        usable = load.usable
        keys = self._pages_of(load.tokens)[: len(load.matched) + usable]
        node, path, duplicates = self._insert(keys, load.matched + load.pages[:usable],
                                              PrefixMatch(handle=load.handle, pages=load.matched))
        assert node is not None  # nothing was handed over
        for loaded in path[len(load.matched) :]:
            loaded.stored = loaded.stored or self.tiers.on_disk(loaded.hash)
        self.allocator.free(duplicates + load.pages[usable:])
        self.lock(node)
        load.pin = node
        self.unlock(load.handle)
        load.done = True

    def cancel_load(self, load: KVLoad) -> None:
        if load.done:
            self.unlock(load.pin)
            return
        assert self.tiers is not None
        self.tiers.cancel(load)
        self.allocator.free(load.pages)
        self.unlock(load.handle)

    def wait_loads(self, timeout: float) -> None:
        if self.tiers is not None and self.tiers.loads:
            self.tiers.wait(timeout)

    @property
    def loading(self) -> bool:
        return self.tiers is not None and bool(self.tiers.loads)

    def tier_use(self) -> list[TierUse]:
        return self.tiers.use(waiting=len(self._unstaged) + len(self._pending)) if self.tiers is not None else []

    @property
    def unstaged(self) -> bool:
        return bool(self._unstaged or self._pending)

    def flush(self, timeout: float = 60.0) -> bool:
        """Write through every cached page not written yet (at idle every one is final), as many at a time as the
        staging ring holds, and wait for the writes; False if that took longer than `timeout` seconds."""
        if self.tiers is None:
            return True
        deadline = time.monotonic() + timeout
        self._pending.clear()
        self._store(list(self.by_page.values()))
        while self._unstaged:
            if not self.tiers.flush(deadline - time.monotonic()):
                return False
            self.processed(0)
        return self.tiers.flush(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.tiers is not None:
            self.flush()
            self.tiers.close()

    def check_integrity(self, idle: bool = False) -> None:
        super().check_integrity(idle)
        if self.tiers is not None:
            self.tiers.check_integrity(idle)

    def cached_pages(self) -> dict[int, bool]:
        return {page: node.lock_ref > 0 for page, node in self.by_page.items()}

    def cached_lock(self, page: int) -> bool | None:
        node = self.by_page.get(page)
        return None if node is None else node.lock_ref > 0

    @property
    def evictable_size(self) -> int:
        # A locked node locks its ancestors too, so every unlocked node can be reached by leaf eviction.
        return len(self.by_page) - self._locked
