"""Paged KV memory: the page pool, who owns which page, and the request table."""

from engine.kv.allocator import PageAllocator
from engine.kv.cache import CacheManager, NaiveCacheManager, PrefixMatch, make_cache_manager
from engine.kv.pool import KVPool
from engine.kv.table import RequestTable

__all__ = [
    "CacheManager",
    "KVPool",
    "NaiveCacheManager",
    "PageAllocator",
    "PrefixMatch",
    "RequestTable",
    "make_cache_manager",
]
