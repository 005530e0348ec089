"""Real models' chat templates for the tests: the copies llama.cpp keeps of them (`models/templates/`, each
the template of the model it names, as its tokenizer_config.json has it), read from the `llama-cpp-python`
sdist on PyPI, which vendors llama.cpp, and kept in the user cache after the first call (the way
tests/real_model.py fetches its model)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kernels.cpu.build import cache_dir

SDIST = "llama-cpp-python==0.3.36"  # the one scripts/bench_llamacpp.py builds llama.cpp from
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
DEEPSEEK_R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
NAMES = (QWEN3, DEEPSEEK_R1)


def real_template(name: str) -> str:
    """The template llama.cpp keeps as `name`; the sdist (76 MB) is downloaded on the first call only."""
    target = cache_dir() / "templates" / name
    if not target.is_file():
        _fetch(target.parent)
    return target.read_text()


def _fetch(into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=into) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
                        "-d", tmp], check=True)
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as sdist:
            for member in sdist.getmembers():
                if member.name.endswith(tuple(f"/models/templates/{n}" for n in NAMES)):
                    data = sdist.extractfile(member)
                    assert data is not None
                    part = Path(tmp) / Path(member.name).name
                    part.write_bytes(data.read())
                    os.replace(part, into / part.name)
