"""`minichat serve --http` on a checkpoint, for the tests that drive an API through its official SDK."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from engine.service.client import probe
from tests.test_http_api import wait_http
from tui.bench.fleet import free_port, minichat, stop


def serve_http(model: Path, *options: str) -> Iterator[tuple[str, str]]:
    """(root URL, engine address) of `minichat serve --http` on `model`, served as "m", with `options`;
    stopped afterwards, and its engine with it."""
    address = f"ipc://{tempfile.mkdtemp(prefix='mcs')}/engine.sock"
    port = free_port()
    process = subprocess.Popen(minichat("serve", "--http", f"127.0.0.1:{port}", "--address", address, "--model",
                                        str(model), "--served-model-name", "m", *options),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http(process, root + "/health")
        assert not loads_torch(process.pid), "the HTTP front imported torch (its engine is another process)"
        yield root, address
    finally:
        stop(process)
    assert probe(address) is None


def loads_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped (the front of `serve --http` needs ~2.5 s less CPU and some
    hundred MiB less memory without it)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
