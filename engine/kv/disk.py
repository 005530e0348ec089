"""The disk tier: KV pages as files under `--kv-cache-dir`, one file a page, checksummed, capped, least recently
used first out; every file operation on a thread of its own, never on the scheduler's.

Where: `<dir>/<fingerprint>/<key[:2]>/<key>.kv`, `key` the page's chain key (engine/kv/tiers.py: a hash of the
fingerprint and every token up to the page's end), so a file names its whole prefix and another model's pages
live in another directory. A file is a header (`HEADER`: magic, version, page size, the fingerprint, the key,
its parent's key, the payload's length), the page's token ids, the payload (its K/V as KVPool.read_pages lays
a page out) and a CRC-32 of all of that. A read checks all of it against what the reader expects: a file too
short is "truncated", one whose bytes do not match its checksum (or that is not a page file) "corrupt", one of
another fingerprint, layout or prefix "foreign", one that vanished (another engine evicted it) "missing". Such a
file is counted, logged, deleted (so it is not found again) and its page computed again; it is never used.
Nothing outside the directory is touched through it: the tier's directories must be real directories of this
user, not links, and every file is opened relative to them without following a link (`O_NOFOLLOW`) or blocking
(`O_NONBLOCK`: a FIFO), and checked to be a regular file of a page's size before a byte is read ("unreadable";
so is any OS error or failed allocation reading it).

Two engines may share a directory: a file is written to a temporary name and renamed into place (readers see a
whole file or none; a reader that opened one keeps it when another engine replaces or deletes it), and each
engine's index of the files is brought up to date from the directory (`rescan`) at start, before it evicts, and
when its writer has been idle RESCAN_EVERY seconds and a directory of the tier has changed since the last scan
(`_stamp`: the directories' modification times, a few hundred stats where a scan stats every file: 215,000 files
took 5 s), so the cap counts the other engine's files too and an idle engine stays idle. The cap (`cap_bytes`) holds the
whole directory, every fingerprint's files together: before a write that would pass it, the least recently
used files are deleted until the directory is LOW_WATER of the cap. A write that fails (a full disk, a file
size limit, a read-only directory) is logged, counted, and pauses writing for WRITE_PAUSE seconds: the engine
serves on, recomputing what it could not store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.pages import REJECTIONS
from kernels.cpu.build import cache_dir

log = logging.getLogger(__name__)

MAGIC = b"MCKV"
VERSION = 1
HEADER = struct.Struct("<4sHH16s16s16sQ")  # magic, version, page size, fingerprint, key, parent key, payload bytes
CRC = struct.Struct("<I")
SUFFIX = ".kv"
LOW_WATER = 0.9  # an eviction deletes down to this share of the cap, so that not every write evicts
RESCAN_EVERY = 30.0  # seconds of an idle writer between two looks at the directory (other engines' files come and go)
RESCAN_SPACING = 2.0  # and at least, however often an eviction wants one
WRITE_PAUSE = 10.0  # seconds writing stays off after a write failed
STALE_TMP = 600.0  # seconds after which a temporary file is a crashed writer's (deleted at a scan)
DIR_ENV = "MINICHAT_KV_CACHE_DIR"


def default_dir() -> Path:
    """Where the disk tier lives unless told: $MINICHAT_KV_CACHE_DIR, else `kv` in the user's cache directory."""
    return Path(os.environ[DIR_ENV]) if os.environ.get(DIR_ENV) else cache_dir() / "kv"


class PageRejected(Exception):
    """A page file that must not be used; `reason` is one of REJECTIONS (engine/pages.py)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class DiskCounts:
    """What the tier did since start: pages written, files refused by reason, failed writes, pages not written
    (the queue was full or writing paused), and the seconds spent writing and reading."""

    written: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTIONS, 0))
    write_errors: int = 0
    skipped: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0


@dataclass(frozen=True)
class PageFile:
    """What a page file must say: whose (`fingerprint`), which page (`key`, its `parent`, its `tokens`), how big."""

    fingerprint: bytes
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]

    def head(self, payload: int) -> bytes:
        return HEADER.pack(MAGIC, VERSION, len(self.tokens), self.fingerprint, self.key, self.parent, payload) + \
            struct.pack(f"<{len(self.tokens)}q", *self.tokens)

    def check(self, data: bytearray, payload: int) -> int:
        """Where the payload starts in a whole file's `data`; PageRejected if the file is not this page's."""
        if len(data) < HEADER.size + CRC.size:
            raise PageRejected("truncated", f"{len(data)} bytes")
        magic, version, size, fingerprint, key, parent, length = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise PageRejected("corrupt", "not a minichat KV page file")
        start = HEADER.size + 8 * size
        if len(data) < start + length + CRC.size:
            raise PageRejected("truncated", f"{len(data)} bytes of {start + length + CRC.size}")
        if len(data) > start + length + CRC.size:
            raise PageRejected("corrupt", f"{len(data) - start - length - CRC.size} bytes too many")
        (crc,) = CRC.unpack_from(data, len(data) - CRC.size)
        if zlib.crc32(memoryview(data)[: -CRC.size]) != crc:
            raise PageRejected("corrupt", "checksum mismatch")
        if version != VERSION or fingerprint != self.fingerprint or length != payload:
            raise PageRejected("foreign", "another model, dtype or KV layout")
        tokens = struct.unpack_from(f"<{size}q", data, HEADER.size)
        if key != self.key or parent != self.parent or tokens != self.tokens:
            raise PageRejected("foreign", "another prefix's page")
        return start


Job = tuple[PageFile, torch.Tensor, Callable[[], None]] | threading.Event | None  # a write, a flush, close


class DiskTier:
    """Page files for one fingerprint under `root`, an index of the directory's files (least recently used first),
    a writer thread (writes, evictions, rescans) and a reader thread. The scheduler's thread only asks the index
    (`__contains__`) and queues work (`write`, `read`); `on_read` is called (on the reader thread) after each
    read, so a waiting scheduler can wake."""

    def __init__(self, root: Path, fingerprint: bytes, page_shape: tuple[int, ...], dtype: torch.dtype,
                 cap_bytes: int, on_read: Callable[[], None] = lambda: None) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.dir = root / fingerprint.hex()
        self.page_shape = page_shape
        self.dtype = dtype
        self.payload = torch.Size(page_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.cap_bytes = cap_bytes
        self.on_read = on_read
        self.counts = DiskCounts()
        self.degraded = ""  # why writing is paused now ("" when it is not)
        self._lock = threading.Lock()
        # every page file in `root` by its fingerprint + key (32 bytes: 170 bytes an entry where a Path and a set
        # of keys took 545, and a cap of 8 GiB holds 233,000 of the demo model's pages), least recently used first
        self._files: OrderedDict[bytes, int] = OrderedDict()
        self._own = 0  # how many of them are this fingerprint's
        self._total = 0
        self._file_bytes = HEADER.size + 8 * page_shape[2] + self.payload + CRC.size
        self._pending = 0  # writes queued
        self._paused_until = 0.0
        self._scanned_at = -float("inf")
        self._scanned_stamp: dict[str, int] = {}  # the directories' modification times at the last scan
        self._jobs: queue.Queue[Job] = queue.Queue()
        self.root.mkdir(parents=True, exist_ok=True)
        _check_own_dir(self.root)
        with contextlib.suppress(FileExistsError):
            self.dir.mkdir()
        _check_own_dir(self.dir)
        self._dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.rescan()
        self._evict(0)  # the cap may be smaller than last time
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="minichat-kv-read")
        self._writer = threading.Thread(target=self._write_loop, name="minichat-kv-write", daemon=True)
        self._writer.start()

    # -- the scheduler's side -------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return self.fingerprint + key in self._files

    @property
    def pages(self) -> int:
        return self._own

    @property
    def total_bytes(self) -> int:
        """The page files in the directory, every fingerprint's, as this engine last knew them."""
        return self._total

    @property
    def file_bytes(self) -> int:
        return self._file_bytes

    def path(self, key: bytes) -> Path:
        return self._path(self.fingerprint + key)

    def _is_own(self, name: bytes) -> bool:
        """Whether an index entry is this fingerprint's page (the others are other models' files in `root`)."""
        return name[:16] == self.fingerprint

    def _path(self, name: bytes) -> Path:
        """The file of an index entry (a fingerprint and a key, 16 bytes each)."""
        key = name[16:].hex()
        return self.root / name[:16].hex() / key[:2] / _file_name(name[16:])

    def write(self, page: PageFile, data: torch.Tensor, done: Callable[[], None]) -> bool:
        """Queue one page's K/V (a contiguous host tensor of `page_shape`) for writing; False when it will not be
        stored (writing is paused, or a page does not fit the cap), True if it is or will be. `done()` is called
        once `data` is no longer needed: at once, or on the writer thread after the write."""
        if page.key in self:
            done()
            return True
        with self._lock:
            if not self.accepting:
                self.counts.skipped += 1
                done()
                return False
            self._pending += 1
        self._jobs.put((page, data, done))
        return True

    @property
    def accepting(self) -> bool:
        """Whether a write now would be tried: writing is not paused after a failure, and a page fits the cap."""
        return time.monotonic() >= self._paused_until and self.file_bytes <= self.cap_bytes

    def skipped(self, pages: int) -> None:
        """Pages not handed to `write` at all (it was not `accepting`)."""
        with self._lock:
            self.counts.skipped += pages

    def late(self, pages: int) -> None:
        """Pages whose reads passed the load deadline (engine/kv/tiers.py): they are computed instead."""
        with self._lock:
            self.counts.rejected["late"] += pages
        log.warning("KV disk tier: %d page reads in %s passed the deadline; their tokens are computed again", pages,
                    self.dir)

    def read(self, page: PageFile) -> Future[torch.Tensor]:
        """The page's K/V read back and checked (PageRejected if the file must not be used)."""
        future = self._reader.submit(self._read, page)
        future.add_done_callback(lambda _: self.on_read())
        return future

    def flush(self, timeout: float) -> bool:
        """Wait until every write queued so far is done; False if that took longer than `timeout` seconds."""
        if not self._writer.is_alive():  # closed
            return True
        done = threading.Event()
        self._jobs.put(done)
        return done.wait(timeout)

    def close(self, timeout: float) -> None:
        """Finish the queued writes (for at most `timeout` seconds), then stop both threads."""
        if not self._writer.is_alive():
            return
        self.flush(timeout)
        self._jobs.put(None)
        self._writer.join(timeout)
        self._reader.shutdown(wait=True, cancel_futures=True)
        os.close(self._dir_fd)

    def check_integrity(self) -> None:
        """The index adds up and, once the writes are done, holds the cap."""
        with self._lock:
            total, files, pending, own = self._total, dict(self._files), self._pending, self._own
        if total != sum(files.values()):
            raise AssertionError(f"disk tier: index total {total} != the sum of its files {sum(files.values())}")
        if not pending and total > self.cap_bytes:
            raise AssertionError(f"disk tier: {total} bytes indexed over the cap of {self.cap_bytes}")
        if own != sum(map(self._is_own, files)):
            raise AssertionError(f"disk tier: {own} pages of this model counted, not what the index holds")

    # -- the reader thread ----------------------------------------------------------------------
    def _read(self, page: PageFile) -> torch.Tensor:
        start = time.perf_counter()
        name = self.fingerprint + page.key
        path = self._path(name)
        try:
            data = self._read_file(page.key)
            at = page.check(data, self.payload)
        except FileNotFoundError:
            self._forget(name)
            with self._lock:
                self.counts.rejected["missing"] += 1
            raise PageRejected("missing", str(path)) from None
        except (OSError, MemoryError, PageRejected) as e:
            rejected = e if isinstance(e, PageRejected) else PageRejected("unreadable", f"{type(e).__name__}: {e}")
            log.warning("KV disk tier: %s is %s; deleted, its tokens are computed again", path, rejected)
            self._delete(name)
            with self._lock:
                self.counts.rejected[rejected.reason] += 1
            raise rejected from None
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
            self.counts.read_seconds += time.perf_counter() - start
        tensor = torch.frombuffer(data, dtype=torch.uint8, offset=at, count=self.payload)
        return tensor.view(self.dtype).view(self.page_shape)

    def _read_file(self, key: bytes) -> bytearray:
        """A page file's bytes, opened without following a link or blocking, and read only if it is a regular file of
        at most twice a page's size (PageRejected otherwise; OSError as the system raises it). Its modification time
        becomes now: when it was last used, for every engine's LRU order."""
        sub = self._sub_fd(key, create=False)
        try:
            fd = os.open(_file_name(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sub)
        finally:
            os.close(sub)
        with os.fdopen(fd, "rb", buffering=0) as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise PageRejected("unreadable", "not a regular file")
            if info.st_size > 2 * self._file_bytes:  # not read at all (a sparse file of gigabytes, say)
                raise PageRejected("corrupt", f"{info.st_size} bytes where a page file has {self._file_bytes}")
            data = bytearray(info.st_size)  # a page's size, or another one's that `check` tells apart
            view, got = memoryview(data), 0
            while got < len(data):
                n = f.readinto(view[got:])
                if not n:
                    raise PageRejected("truncated", f"{got} bytes of {len(data)}")
                got += n
            with contextlib.suppress(OSError):
                os.utime(fd)
        return data

    def _sub_fd(self, key: bytes, create: bool) -> int:
        """A descriptor of the subdirectory a key's file is in (made first if `create`), not through a link."""
        sub = key.hex()[:2]
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(sub, 0o700, dir_fd=self._dir_fd)
        return os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)

    # -- the writer thread ----------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=RESCAN_EVERY)
            except queue.Empty:
                if self._stamp() != self._scanned_stamp:
                    self.rescan()
                continue
            if job is None:  # close
                return
            if isinstance(job, threading.Event):  # flush: everything queued before it is done
                job.set()
                continue
            page, data, done = job
            try:
                self._store(page, data)
            finally:
                done()
                with self._lock:
                    self._pending -= 1

    def _store(self, page: PageFile, data: torch.Tensor) -> None:
        name = self.fingerprint + page.key
        if name in self._files:
            return
        start = time.perf_counter()
        size = self.file_bytes
        self._evict(size)
        final = _file_name(page.key)
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        head = page.head(self.payload)
        payload = data.contiguous().view(torch.uint8).numpy().data.cast("B")
        sub = -1
        try:
            sub = self._sub_fd(page.key, create=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=sub)
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(payload)
                f.write(CRC.pack(zlib.crc32(payload, zlib.crc32(head))))
            os.replace(tmp, final, src_dir_fd=sub, dst_dir_fd=sub)
        except OSError as e:
            if sub >= 0:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=sub)
            self._failed(e)
            return
        finally:
            if sub >= 0:
                os.close(sub)
        with self._lock:
            self._add(name, size)
            self.counts.written += 1
            self.counts.write_seconds += time.perf_counter() - start
            self.degraded = ""

    def _failed(self, error: OSError) -> None:
        with self._lock:
            self.counts.write_errors += 1
            first = not self.degraded
            self.degraded = f"writes failed ({error.strerror or error}); paused"
            self._paused_until = time.monotonic() + WRITE_PAUSE
        if first:
            log.warning("KV disk tier: writing to %s failed (%s); pages are not stored for %.0f s, then tried again "
                        "(the engine serves on, computing what is not stored)", self.dir, error, WRITE_PAUSE)

    def _evict(self, incoming: int) -> None:
        """Delete least recently used files until `incoming` more bytes fit under the cap (to LOW_WATER of it)."""
        if self._total + incoming <= self.cap_bytes:
            return
        if time.monotonic() - self._scanned_at >= RESCAN_SPACING:
            self.rescan()  # count (and do not try to delete twice) what other engines wrote or deleted
        goal = max(0, int(self.cap_bytes * LOW_WATER) - incoming)
        while self._total > goal and self._files:
            with self._lock:
                name = next(iter(self._files))
            self._delete(name)

    # -- the index --------------------------------------------------------------------------------
    def rescan(self) -> None:
        """Rebuild the index from the directory: every fingerprint's page files (a file not named as
        `<fingerprint>/<key[:2]>/<key>.kv` is not one, and is left alone), ordered by modification time (when
        each was last used); temporary files of crashed writers are deleted."""
        found: list[tuple[float, bytes, int]] = []
        sizes: dict[int, int] = {}  # one int object per file size, not one per file
        now = time.time()
        stamp = self._stamp()
        for top, _, names in os.walk(self.root):
            for filename in names:
                path = Path(top) / filename
                name = _name_of(path) if filename.endswith(SUFFIX) else None
                if name is None and not filename.endswith(".tmp"):
                    continue
                try:
                    info = path.lstat()
                except OSError:  # deleted meanwhile
                    continue
                if name is not None:
                    size = self._indexed_size(info)
                    found.append((info.st_mtime, name, sizes.setdefault(size, size)))
                elif now - info.st_mtime > STALE_TMP:
                    with contextlib.suppress(OSError):
                        path.unlink()
        found.sort(key=lambda f: f[0])
        with self._lock:
            self._files = OrderedDict((name, size) for _, name, size in found)
            self._total = sum(size for _, _, size in found)
            self._own = sum(map(self._is_own, self._files))
            self._scanned_at = time.monotonic()
            self._scanned_stamp = stamp

    @staticmethod
    def _indexed_size(info: os.stat_result) -> int:
        """The bytes a file named as a page counts against the cap: the blocks it takes on disk (a huge sparse file
        must not evict every page), 0 for what is not a regular file (a read refuses both)."""
        return min(info.st_size, info.st_blocks * 512) if stat.S_ISREG(info.st_mode) else 0

    def _stamp(self) -> dict[str, int]:
        """Every directory of the tier (fingerprints and their two-hex-digit subdirectories) and its modification
        time: a file written, renamed into place or deleted in one changes it."""
        stamp: dict[str, int] = {}
        with contextlib.suppress(OSError):
            stamp[str(self.root)] = self.root.stat().st_mtime_ns
            for top in os.scandir(self.root):
                if top.is_dir():
                    stamp[top.path] = top.stat().st_mtime_ns
                    for sub in os.scandir(top.path):
                        if sub.is_dir():
                            stamp[sub.path] = sub.stat().st_mtime_ns
        return stamp

    def _add(self, name: bytes, size: int) -> None:
        old = self._files.pop(name, None)
        self._total += size - (old or 0)
        self._own += old is None and self._is_own(name)
        self._files[name] = size

    def _forget(self, name: bytes) -> None:
        with self._lock:
            old = self._files.pop(name, None)
            if old is not None:
                self._total -= old
                self._own -= self._is_own(name)

    def _delete(self, name: bytes) -> None:
        self._forget(name)
        with contextlib.suppress(OSError):
            self._path(name).unlink()


def _file_name(key: bytes) -> str:
    """A page's file name in its subdirectory (`<key[:2]>/`)."""
    return f"{key.hex()}{SUFFIX}"


def _check_own_dir(path: Path) -> None:
    """Refuse (ValueError) a directory of the tier that is a link or another user's: pages must not be read from, or
    written to, anywhere else."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"KV disk tier: {path} is {'a link' if stat.S_ISLNK(info.st_mode) else 'not a directory'}; "
                         f"refusing to keep pages through it (point --kv-cache-dir at a real directory)")
    if info.st_uid != os.geteuid():
        raise ValueError(f"KV disk tier: {path} belongs to another user; refusing to keep pages there")


def _name_of(path: Path) -> bytes | None:
    """The index entry of a page file's path (its fingerprint's 16 bytes and its key's), None if it is not named
    as one."""
    key = path.name.removesuffix(SUFFIX)
    if len(key) != 32 or path.parent.name != key[:2] or len(path.parent.parent.name) != 32:
        return None
    with contextlib.suppress(ValueError):
        return bytes.fromhex(path.parent.parent.name) + bytes.fromhex(key)
    return None
