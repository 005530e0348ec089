"""minichat replicas with the fleet tools people already run (issue 26): vllm-htop reads a replica's
`/metrics` by vLLM's names and reports the engine's own numbers, and SGLang's gateway (`smg`) spreads
requests over two replicas, which do not sample in lockstep."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest

from engine.service.client import EngineClient
from tests.test_http_api import free_port, minichat, stop, wait_http


@dataclass
class Replica:
    url: str  # http://127.0.0.1:PORT
    address: str  # its engine's


@contextmanager
def replica() -> Iterator[Replica]:
    """`minichat serve --http` on the demo model."""
    address = f"ipc://{tempfile.mkdtemp(prefix='mcf')}/engine.sock"
    port = free_port()
    process = subprocess.Popen(minichat("serve", "--http", f"127.0.0.1:{port}", "--address", address),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_http(process, f"http://127.0.0.1:{port}/health")
        yield Replica(f"http://127.0.0.1:{port}", address)
    finally:
        stop(process)


def tool(name: str) -> str:
    path = shutil.which(name, path=str(__import__("pathlib").Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} is not installed (pip install '.[dev]' installs it)")
    return path


def test_vllm_htop_reads_a_replica_as_minichat_status_does():
    htop = tool("vllm-htop")
    with replica() as rep, EngineClient(rep.address) as engine:
        sdk = openai.OpenAI(base_url=rep.url + "/v1", api_key="none", max_retries=0)
        stream = sdk.completions.create(model="demo_model", prompt="Once more unto the breach", max_tokens=900,
                                        stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # it runs now
        try:
            report = subprocess.run([htop, "--url", rep.url, "--once", "--output", "json"], capture_output=True,
                                    text=True, timeout=60, check=True)
            stats = engine.stats()
        finally:
            stream.close()
        (row,) = json.loads(report.stdout.splitlines()[-1])["replicas"]
        assert row["status"] == "OK" and row["model"] == "demo_model"
        assert row["running"] == len(stats.running) == 1 and row["waiting"] == len(stats.waiting) == 0
        used = (stats.pages.held + stats.pages.locked) / stats.pages.total
        assert row["kv_pct"] == pytest.approx(100 * used, abs=100 * 2 / stats.pages.total)  # a page either way
        assert row["lifetime"]["prompt_tokens_total"] is not None


def test_two_replicas_behind_smg_share_the_load_and_sample_apart():
    smg = tool("smg")
    with ExitStack() as stack:
        replicas = [stack.enter_context(replica()) for _ in range(2)]
        # unseeded sampling differs between replicas (each engine draws its own seed)
        texts = [openai.OpenAI(base_url=r.url + "/v1", api_key="none").completions.create(
            model="demo_model", prompt="To be, or not to be", max_tokens=24, temperature=1.0,
            extra_body={"ignore_eos": True}).choices[0].text for r in replicas]
        assert texts[0] != texts[1]
        port = free_port()
        gateway = subprocess.Popen([smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy",
                                    "round_robin", "--worker-urls", *(r.url for r in replicas)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        stack.callback(stop, gateway)
        url = f"http://127.0.0.1:{port}"
        wait_http(gateway, url + "/health")
        before = [EngineClient(r.address).stats().counters.submitted for r in replicas]
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for i in range(8):
            out = sdk.completions.create(model="demo_model", prompt=f"Speak, number {i}", max_tokens=4)
            assert out.choices[0].finish_reason in ("stop", "length")
        after = [EngineClient(r.address).stats().counters.submitted for r in replicas]
        served = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(served) == 8 and min(served) >= 2, served
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
