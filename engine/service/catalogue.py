"""The models a multi-model server may run: `--models-dir DIR` (every GGUF file and checkpoint folder in it) and
`--model NAME=PATH`, each with an id, its format and its size. Reading a catalogue opens no weights (a light
module: the HTTP front never imports torch); whether an entry really loads is found out when it is loaded.

    catalogue = Catalogue.of(dirs=["~/models"], named=["small=/m/smollm2.gguf"])
    catalogue["small"].weight_bytes
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.config import model_id
from engine.service.addresses import runtime_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin")
FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class CatalogueError(ValueError):
    """The catalogue cannot be built as given: a directory that is not one, two entries with one id."""


@dataclass(frozen=True)
class Entry:
    """One model the server may run."""

    id: str
    path: Path
    format: str  # "gguf" or "checkpoint"
    disk_bytes: int  # the weight files' size

    def weight_bytes(self, dtype: str) -> int:
        """What its weights take in memory once loaded at `dtype` (--dtype): a GGUF file's blocks stay as they are;
        a checkpoint's floats widen or narrow to `dtype` (bf16 files computed in float32 take twice their size)."""
        if self.format == "gguf":
            return self.disk_bytes
        stored = FLOAT_BYTES.get(_checkpoint_dtype(self.path), 4)
        return self.disk_bytes * FLOAT_BYTES.get(dtype, 4) // stored

    def describe(self) -> dict[str, object]:
        return {"id": self.id, "format": self.format, "path": str(self.path), "size_bytes": self.disk_bytes}


class Catalogue:
    """Entries by id, in the order given (directories' entries sorted by name)."""

    def __init__(self, entries: Iterable[Entry]) -> None:
        self.entries: dict[str, Entry] = {}
        for entry in entries:
            if entry.id in self.entries:
                raise CatalogueError(f"two models have the id {entry.id!r}: {self.entries[entry.id].path} and "
                                     f"{entry.path}; name one with --model NAME=PATH")
            self.entries[entry.id] = entry

    @classmethod
    def of(cls, dirs: Iterable[str | Path] = (), named: Iterable[str] = ()) -> Catalogue:
        """Every model in `dirs`, then each `NAME=PATH` of `named`; CatalogueError for an unusable argument."""
        entries: list[Entry] = []
        for d in dirs:
            path = Path(d).expanduser()
            if not path.is_dir():
                raise CatalogueError(f"--models-dir {d}: not a directory")
            entries.extend(e for child in sorted(path.iterdir()) if (e := entry_of(child)) is not None)
        for item in named:
            name, sep, where = item.partition("=")
            if not sep or not name or not where:
                raise CatalogueError(f"--model {item!r}: expected NAME=PATH (one model alone needs no name)")
            entry = entry_of(Path(where).expanduser(), name)
            if entry is None:
                raise CatalogueError(f"--model {item}: {where} is neither a .gguf file nor a checkpoint folder "
                                     f"(config.json)")
            entries.append(entry)
        catalogue = cls(entries)
        if not catalogue.entries:
            raise CatalogueError("no models: the --models-dir directories hold no .gguf file or checkpoint folder")
        return catalogue

    def __getitem__(self, model: str) -> Entry:
        return self.entries[model]

    def __contains__(self, model: object) -> bool:
        return model in self.entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries.values())

    def ids(self) -> list[str]:
        return list(self.entries)

    def find(self, name: str) -> Entry | None:
        """The entry an engine's model name stands for: its id, or the name its path is served under."""
        return self.entries.get(name) or next((e for e in self if model_id(str(e.path)) == name), None)


def engine_address(owner: str, model: str) -> str:
    """The private ipc socket of `owner`'s engine for `model` (an owner: a server, a console; the runtime
    directory is the user's own, and the name stays short of the socket path's limit)."""
    key = hashlib.sha1(f"{owner}:{model}".encode()).hexdigest()[:12]
    return f"ipc://{runtime_dir() / f'model-{key}.sock'}"


def entry_of(path: Path, name: str | None = None) -> Entry | None:
    """`path` as an entry (id: `name`, else the file's name without .gguf or the folder's), or None when it is
    neither a GGUF file nor a checkpoint folder. A hidden file is skipped; a broken one is still an entry (its
    requests will say why it does not load)."""
    if path.name.startswith("."):
        return None
    if path.is_file() and path.suffix == ".gguf":
        return Entry(name or model_id(str(path)), path.resolve(), "gguf", path.stat().st_size)
    if path.is_dir() and (path / "config.json").is_file():
        size = sum(f.stat().st_size for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())
        return Entry(name or model_id(str(path)), path.resolve(), "checkpoint", size)
    return None


def _checkpoint_dtype(path: Path) -> str:
    """The dtype config.json says the weights are stored in (float32 when it does not say or cannot be read)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    dtype = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    return dtype if isinstance(dtype, str) else "float32"
