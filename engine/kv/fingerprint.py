"""What stored KV pages are valid for: a model fingerprint, so KV of another model, dtype or layout is never used.

A page's K/V depend on the weights, the dtype they were computed in, how tokens are grouped into pages and
how the pool lays them out (layers, KV heads per rank, head size, element size). The fingerprint hashes all
of it; the disk tier keeps each fingerprint's pages in a directory of its own and every file repeats it in
its header (engine/kv/disk.py). The weights' identity is a hash of their files' bytes: a checkpoint copied
elsewhere keeps it, a fine-tune of the same shape does not. Hashing a 1 GB file takes about a second, so
each file's hash is remembered by path, size, modification time and inode (`WEIGHTS_MEMO`, in minichat's cache
directory), and a later start only stats the files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

WEIGHTS_MEMO = "weights.json"
LAYOUT = "pages x [layers, K|V, page_size, kv_heads, head_dim], v1"  # how KVPool.read_pages lays a page out
CHUNK = 1 << 24


def file_digest(path: Path, memo: Path) -> str:
    """The blake2b hash of a file's bytes, remembered in `memo` (a JSON file) under what identifies this version
    of the file; a memo that cannot be read or written costs only the hashing."""
    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    known: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        known = json.loads(memo.read_text())
    if ident in known:
        return known[ident]
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    known[ident] = digest.hexdigest()
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(known, indent=0))
        os.replace(tmp, memo)  # another engine's memo written meanwhile loses to ours: it is only a memo
    return known[ident]


def fingerprint(weight_files: list[Path], memo: Path, facts: Mapping[str, object]) -> bytes:
    """16 bytes naming what KV pages are valid for: the weights' bytes and `facts` (dtype, quantization, page
    size, tensor-parallel layout, the pool's layout)."""
    described = {"weights": [file_digest(f, memo) for f in weight_files], "layout": LAYOUT, **facts}
    return hashlib.blake2b(json.dumps(described, sort_keys=True, default=str).encode(), digest_size=16).digest()
