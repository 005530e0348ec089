"""KV tiers under the radix cache: host memory (engine/kv/host.py) and disk (engine/kv/disk.py) below the pool.

Pages are named by chain keys: a page's key hashes its parent's key and its own token ids, the first page's
parent being the model fingerprint (engine/kv/fingerprint.py), so a key names the whole prefix up to the
page's end, for this model, dtype and layout only. The radix tree keeps each node's key (engine/kv/radix.py).

Writing: the disk tier is written through. A page's K/V is final once no batch will write it again: when its
request releases it (at once), or when the batch that may still write a page handed over early or shared is
processed (`RadixCacheManager.processed`); then it is copied out of the pool on the scheduler's thread (a memory
copy) and queued for the disk writer. So an engine that stops, or restarts, finds on disk what its pool had,
and a page the pool evicts costs nothing more. The host tier takes what the pool evicts (a copy, then the page
is the pool's again), least recently used out.

Reading: a prefix match walks the pool, then the host and the disk tiers (`find`): the pages found below extend
the match. Their request waits ("loading_kv"): the pages get pool pages of their own, owned by it, host pages
are copied in at once and disk pages read on the disk tier's thread (`start`); the scheduler collects what has
arrived before each step (`collect`), copies it in, and once every page is in (or the first one that could not
be used is known: the rest of the chain is no use), the radix cache adds them to the tree and the request is
admitted over them. Nothing here blocks the scheduler on a file.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.kv.disk import DiskTier, PageFile, PageRejected
from engine.kv.host import HostTier
from engine.kv.pool import KVPool
from engine.pages import TierUse

log = logging.getLogger(__name__)
STAGING_BYTES = 64 << 20  # pages waiting for the disk writer at most (a 4,000-token chat, 0.5B, bf16: 48 MiB) ...
STAGING_SHARE = 16  # ... and at most a 16th of the pool (at least STAGING_MIN pages)
STAGING_MIN = 64
LOAD_DEADLINE = 10.0
"""Seconds a load's disk reads may take before the pages still out are computed instead: a page reads in
milliseconds, so only a stuck file (a hung mount) or a badly overloaded disk takes this long."""


def chain_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The key of the page holding `tokens` after the prefix whose last page is keyed `parent`."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


@dataclass(frozen=True)
class Stored:
    """A pool page to copy down: its key, its parent's key, its tokens."""

    page: int
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]

    def file(self, fingerprint: bytes) -> PageFile:
        return PageFile(fingerprint, self.key, self.parent, self.tokens)


@dataclass(frozen=True)
class LowerPage:
    """A page of a prompt found below the pool, in `tier` ("host" or "disk")."""

    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    tier: str


@dataclass(frozen=True)
class Below:
    """What a match finds below the pool: the pages that extend it, in order, or that another request is loading
    them now (`busy`: wait for that load rather than read them twice)."""

    pages: tuple[LowerPage, ...] = ()
    busy: bool = False


@dataclass(eq=False)
class KVLoad:
    """One request's pages on their way up: `lower[i]` goes into pool page `pages[i]`. `handle` is the pool prefix
    they extend (`matched` its pages, `tokens` the prompt up to their end), locked while they load. `failed` is the
    first page that could not be used; `pin` the whole path, locked for the request once the pages are in the
    tree; `from_tier` how many pages each tier gave."""

    owner: str
    tokens: list[int]
    handle: object
    matched: list[int]
    lower: tuple[LowerPage, ...]
    pages: list[int]
    ready: list[bool] = field(default_factory=list)
    reads: dict[int, Future[torch.Tensor]] = field(default_factory=dict)
    failed: int | None = None
    pin: object = None
    done: bool = False
    started: float = field(default_factory=time.monotonic)

    @property
    def usable(self) -> int:
        """The pages that can be used: those before the first that failed."""
        return len(self.lower) if self.failed is None else self.failed

    @property
    def complete(self) -> bool:
        return all(self.ready[: self.usable])

    def from_tier(self, tier: str) -> int:
        return sum(p.tier == tier for p in self.lower[: self.usable])


class Staging:
    """Host memory pages wait in for the disk writer: a ring of page slots, taken in order by the scheduler's thread
    and given back by the writer's (or at once, for a page not written), the ring's tail passing only slots given
    back. Allocated once, at the first use, and touched whole then: a fresh tensor per copy costs its page faults,
    several times the copy itself, and a ring touched as it turns would grow the engine's memory for a while."""

    def __init__(self, slots: int, page_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._shape, self._dtype = (slots, *page_shape), dtype
        self._buffer: torch.Tensor | None = None
        self.slots = slots
        self._head = 0  # the next slot to take
        self._tail = 0  # the oldest slot taken
        self._used = 0
        self._given = [False] * slots  # taken slots given back, that the tail has not passed yet
        self._lock = threading.Lock()

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.zeros(self._shape, dtype=self._dtype)
            self._buffer.fill_(0)  # calloc'd memory is faulted in only when written: now, once
        return self._buffer

    def take(self, n: int) -> list[tuple[int, int]]:
        """Up to `n` slots as runs (start, count) of consecutive slots, in ring order (fewer if the ring is full)."""
        with self._lock:
            n = min(n, self.slots - self._used)
            self._used += n
        runs = []
        while n:
            count = min(n, self.slots - self._head)
            runs.append((self._head, count))
            self._head = (self._head + count) % self.slots
            n -= count
        return runs

    def give(self, slot: int) -> None:
        """`slot` is free again (and with it every slot before it that was given back)."""
        with self._lock:
            self._given[slot] = True
            while self._used and self._given[self._tail]:
                self._given[self._tail] = False
                self._tail = (self._tail + 1) % self.slots
                self._used -= 1

    @property
    def used(self) -> int:
        return self._used


class KVTiers:
    """The tiers below one pool (either may be absent), the loads under way, and what the tiers did."""

    def __init__(self, pool: KVPool, fingerprint: bytes, host: HostTier | None, disk: DiskTier | None,
                 staging_bytes: int | None = None) -> None:
        self.pool = pool
        slots = max(1, staging_bytes // pool.page_bytes) if staging_bytes is not None else \
            min(STAGING_BYTES // pool.page_bytes, max(STAGING_MIN, pool.num_pages // STAGING_SHARE))
        self.staging = Staging(slots, pool.page_shape, pool.buffer.dtype) if disk is not None else None
        self.root = fingerprint  # the parent key of every prompt's first page
        self.host = host
        self.disk = disk
        self.loads: list[KVLoad] = []
        self._loading: dict[bytes, KVLoad] = {}  # the keys being loaded
        self._arrived = threading.Event()  # set by the disk tier's reader after each read
        self.loaded = {"host": 0, "disk": 0}  # pages copied back into the pool from each tier
        if disk is not None:
            disk.on_read = self._arrived.set

    def key(self, parent: bytes, tokens: tuple[int, ...]) -> bytes:
        return chain_key(parent, tokens)

    def where(self, key: bytes) -> str | None:
        """The tier holding a page: "host", "disk" or None."""
        if self.host is not None and key in self.host:
            return "host"
        if self.disk is not None and key in self.disk:
            return "disk"
        return None

    def on_disk(self, key: bytes) -> bool:
        return self.disk is not None and key in self.disk

    def find(self, parent: bytes, pages: list[tuple[int, ...]]) -> Below:
        """The pages of `pages` (token tuples, in order, after the prefix ending in `parent`) found below the
        pool, up to the first that is not."""
        found: list[LowerPage] = []
        for tokens in pages:
            key = self.key(parent, tokens)
            if key in self._loading:
                return Below(busy=True)
            tier = self.where(key)
            if tier is None:
                break
            found.append(LowerPage(key, parent, tokens, tier))
            parent = key
        return Below(tuple(found))

    # -- loading ----------------------------------------------------------------------------------
    def start(self, load: KVLoad) -> None:
        """Host pages are copied into the pool now; disk pages are read on the disk tier's thread. A host page
        evicted from the host tier since it was found (making room for this load can) fails there."""
        load.ready = [False] * len(load.lower)
        hosted = [i for i, p in enumerate(load.lower) if p.tier == "host"]
        gone = [i for i in hosted if self.host is None or load.lower[i].key not in self.host]
        if gone:
            load.failed = gone[0]
            hosted = [i for i in hosted if i < gone[0]]
        if hosted:
            assert self.host is not None
            self.pool.write_pages([load.pages[i] for i in hosted], self.host.get([load.lower[i].key for i in hosted]))
            for i in hosted:
                load.ready[i] = True
            self.loaded["host"] += len(hosted)
        for i, page in enumerate(load.lower[: load.usable]):
            if page.tier == "disk":
                assert self.disk is not None
                load.reads[i] = self.disk.read(PageFile(self.root, page.key, page.parent, page.tokens))
        if load.reads:
            for page in load.lower:
                self._loading[page.key] = load
            self.loads.append(load)

    def collect(self) -> list[KVLoad]:
        """Copy into the pool what the disk has read since the last call; the loads now complete (taken off)."""
        self._arrived.clear()
        complete = []
        now = time.monotonic()
        for load in self.loads:
            arrived = [i for i, f in load.reads.items() if f.done()]
            good = []
            for i in arrived:
                try:
                    good.append((i, load.reads.pop(i).result()))
                except PageRejected:
                    load.failed = i if load.failed is None else min(load.failed, i)
            late = [i for i in load.reads if i < load.usable] if now - load.started > LOAD_DEADLINE else []
            if late:  # the reads still out fail: their pages are computed (a stuck file must not hold a request)
                assert self.disk is not None
                self.disk.late(len(late))
                load.failed = min(late) if load.failed is None else min(load.failed, *late)
            good = [(i, data) for i, data in good if i < load.usable]
            if good:
                self.pool.write_pages([load.pages[i] for i, _ in good], torch.stack([data for _, data in good]))
                for i, _ in good:
                    load.ready[i] = True
                self.loaded["disk"] += len(good)
            if load.complete:
                complete.append(load)
        for load in complete:
            self._end(load)
        return complete

    def cancel(self, load: KVLoad) -> None:
        """Forget a load whose request is gone."""
        self._end(load)

    def _end(self, load: KVLoad) -> None:
        """Take a load off; reads it no longer needs (past a failed page, or all of a cancelled load's) are
        cancelled, or finish unseen if running."""
        for future in load.reads.values():
            future.cancel()
        load.reads.clear()
        self.loads.remove(load)
        for page in load.lower:
            if self._loading.get(page.key) is load:
                del self._loading[page.key]

    def wait(self, timeout: float) -> None:
        """Block until a read arrives or `timeout` seconds pass (the scheduler, with nothing else to do)."""
        self._arrived.wait(timeout)

    # -- storing --------------------------------------------------------------------------------
    def store(self, pages: list[Stored]) -> list[bool | None]:
        """Write these pool pages (final: no batch writes them again) through to the disk tier; for each, whether
        it is (or will be) stored there, or None where the staging ring has no room for it now (try again later).
        They are copied into the ring now."""
        if self.disk is None or self.staging is None or not pages:
            return [False] * len(pages)
        if not self.disk.accepting:
            self.disk.skipped(len(pages))
            return [False] * len(pages)
        stored: list[bool | None] = []
        for start, count in self.staging.take(len(pages)):
            batch = pages[len(stored) : len(stored) + count]
            data = self.pool.read_pages([p.page for p in batch], out=self.staging.buffer[start : start + count])
            stored += [self.disk.write(page.file(self.root), kv, functools.partial(self.staging.give, start + i))
                       for i, (page, kv) in enumerate(zip(batch, data, strict=True))]
        return stored + [None] * (len(pages) - len(stored))

    def demote(self, evicted: list[Stored]) -> None:
        """Pages the pool evicts (final) go into the host tier."""
        if self.host is not None and evicted:
            data = self.pool.read_pages([p.page for p in evicted])
            for page, kv in zip(evicted, data, strict=True):
                self.host.put(page.key, kv)

    # -- the rest -------------------------------------------------------------------------------
    def use(self, waiting: int = 0) -> list[TierUse]:
        """Each tier's pages, bytes and counts, for the stats; `waiting`: final pages the staging ring had no room
        for yet (they count as writing, with those in the ring)."""
        out = []
        if self.host is not None:
            h = self.host
            out.append(TierUse(name="host", pages=len(h), capacity=h.capacity, bytes=len(h) * h.page_bytes,
                               capacity_bytes=h.capacity * h.page_bytes, stored=h.stored, loaded=self.loaded["host"]))
        if self.disk is not None:
            d, c = self.disk, self.disk.counts
            out.append(TierUse(name="disk", pages=d.pages, capacity=d.cap_bytes // d.file_bytes, bytes=d.total_bytes,
                               capacity_bytes=d.cap_bytes, stored=c.written, loaded=self.loaded["disk"],
                               loading=sum(len(load.reads) for load in self.loads),
                               writing=(self.staging.used if self.staging is not None else 0) + waiting,
                               rejected={k: v for k, v in c.rejected.items() if v}, write_errors=c.write_errors,
                               skipped=c.skipped, write_seconds=c.write_seconds, read_seconds=c.read_seconds,
                               degraded=d.degraded, where=str(d.dir)))
        return out

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait for the disk writes queued so far (tests, benchmarks, shutdown)."""
        return self.disk is None or self.disk.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        if self.disk is not None:
            self.disk.close(timeout)

    def check_integrity(self, idle: bool) -> None:
        """The tiers add up; at idle no load is under way."""
        if self.host is not None:
            self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()
        if self.staging is not None and not 0 <= self.staging.used <= self.staging.slots:
            raise AssertionError(f"staging ring: {self.staging.used} of {self.staging.slots} slots used")
        if idle and (self.loads or self._loading):
            raise AssertionError(f"idle engine still loads KV for {[load.owner for load in self.loads]}")


def open_tiers(pool: KVPool, fingerprint: bytes, host_bytes: int, disk_dir: Path | None, disk_bytes: int,
               pin: bool) -> KVTiers | None:
    """The tiers asked for below `pool` (None if neither): a host tier of `host_bytes` (`pin`ned: on CUDA), a disk
    tier of `disk_bytes` in `disk_dir`. A directory that cannot be made, or that the tier refuses (a link, another
    user's), is logged and the disk tier is off."""
    host = HostTier(host_bytes // pool.page_bytes, pool.page_shape, pool.buffer.dtype, pin) \
        if host_bytes >= pool.page_bytes else None
    disk = None
    if disk_dir is not None and disk_bytes > 0:
        try:
            disk = DiskTier(disk_dir, fingerprint, pool.page_shape, pool.buffer.dtype, disk_bytes)
        except (OSError, ValueError) as e:  # ValueError: a directory the tier refuses (a link, another user's)
            log.warning("KV disk tier off: cannot use %s (%s)", disk_dir, e)
    return KVTiers(pool, fingerprint, host, disk) if host is not None or disk is not None else None
