"""The suite writes nothing into the user's home: engine sockets and logs, the C kernels, converted GGUF metadata
and conversations go into the session's own directories (tests/conftest.py's `private_dirs`); a suite run used to
leave dozens of `engine-*.log` files in ~/.cache/minichat. The real model's download is the one thing kept in the
user's cache on purpose, and only by the tests that use it (tests/real_model.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = (
    # an engine the launcher starts (its socket, its log), C kernels built at its start, the console's conversations
    "tests/test_tui.py::test_send_message_streams_a_markdown_reply",
    # a GGUF file's metadata converted into the cache
    "tests/test_gguf.py::test_the_files_sampling_metadata_are_the_models_defaults",
)


def test_the_suite_leaves_the_users_home_as_it_found_it(tmp_path: Path) -> None:
    """Tests that write each kind of file, run by pytest in a subprocess whose HOME is an empty directory and
    whose environment names no other directory (no XDG_* or MINICHAT_* variable): HOME stays empty."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "MINICHAT_"))} | {"HOME": str(home)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          "-n", "0", f"--basetemp={tmp_path / 'pytest'}", *TESTS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout, run.stdout[-2000:]
    left = sorted(str(path.relative_to(home)) for path in home.rglob("*"))
    assert left == [], f"the tests wrote into HOME: {left}"
