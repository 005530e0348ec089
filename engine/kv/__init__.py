"""Paged KV memory: the page pool, who owns which page, the request table, the cache policies, and the tiers below
the pool (host memory, disk)."""

from engine.kv.allocator import PageAllocator
from engine.kv.cache import CacheManager, PrefixMatch
from engine.kv.naive import NaiveCacheManager
from engine.kv.pool import KVPool
from engine.kv.radix import RadixCacheManager
from engine.kv.table import RequestTable
from engine.kv.tiers import KVTiers

CACHE_POLICIES: dict[str, type[CacheManager]] = {"radix": RadixCacheManager, "naive": NaiveCacheManager}


def make_cache_manager(kind: str, num_pages: int, page_size: int, tiers: KVTiers | None = None) -> CacheManager:
    """Build the cache policy named in the config; `tiers` go under the radix cache (the only one that keeps pages)."""
    if kind not in CACHE_POLICIES:
        raise ValueError(f"unknown prefix cache {kind!r}; choose one of {', '.join(CACHE_POLICIES)}")
    if kind == "radix":
        return RadixCacheManager(PageAllocator(num_pages), page_size, tiers)
    assert tiers is None, "tiers go under the radix cache"
    return CACHE_POLICIES[kind](PageAllocator(num_pages), page_size)


__all__ = [
    "CACHE_POLICIES",
    "CacheManager",
    "KVPool",
    "KVTiers",
    "NaiveCacheManager",
    "PageAllocator",
    "PrefixMatch",
    "RadixCacheManager",
    "RequestTable",
    "make_cache_manager",
]
