"""Tensor parallelism on CPU (gloo, 2 ranks): the same greedy tokens as one rank and as transformers,
pages freed on every rank, a dead worker rank named within seconds, and `serve --tp 2` end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.distributed.workers import WorkerFailed
from engine.service.client import EngineClient, EngineUnavailable

FAMILIES = ["qwen2", "qwen3", "mistral"]  # tied + biased, q/k norm + explicit head_dim, one KV head (replicated)


def prompts(n: int, seed: int, max_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 384, (int(k),), generator=g).tolist()
            for k in torch.randint(1, max_len, (n,), generator=g)]


def check_all(hf, outputs: list[list[int]], path, batch: list[list[int]], n: int) -> None:
    """Each output is transformers' greedy continuation of its prompt (near-ties either way: conftest.py)."""
    assert len(outputs) == len(batch)
    for out, prompt in zip(outputs, batch, strict=True):
        hf.check_greedy(out, path, prompt, n)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def tokens(llm: LLM, batch: list[list[int]], n: int) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(batch, greedy(n))]


def assert_idle_everywhere(llm: LLM) -> None:
    """Every page free or cached and every slot free on rank 0 (which places every rank's K/V), and
    every worker rank ran exactly the steps rank 0 sent."""
    llm.check_integrity()
    pages = llm.stats().pages
    assert pages.held == pages.locked == 0 and pages.free + pages.cached == llm.num_pages


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_match_one_rank_and_transformers(checkpoints, hf, family):
    path = checkpoints[family]
    batch = prompts(4, seed=11, max_len=40)
    single = tokens(LLM(str(path), max_prefill_tokens=16), batch, 5)
    with LLM(str(path), tensor_parallel_size=2, max_prefill_tokens=16) as llm:  # chunked prefill
        assert llm.model.num_kv_heads == 1  # 2 KV heads split in two; mistral's single one replicated
        assert tokens(llm, batch, 5) == single
        check_all(hf, single, path, batch, 5)
        assert_idle_everywhere(llm)


def test_llama_chunks_prefix_cache_abort_and_a_killed_rank(llama_ckpt, hf):
    """One two-rank engine through chunked prefill, prefix reuse, an abort, and finally a dead worker."""
    system = torch.randint(0, 384, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    followups = [system + p for p in prompts(3, seed=4, max_len=12)]
    with LLM(str(llama_ckpt), tensor_parallel_size=2, page_size=4, max_prefill_tokens=12) as llm:
        assert llm.kv.buffer.shape[-2] == 1  # each rank's KV pool holds its own half of the 2 KV heads
        batch = prompts(3, seed=5, max_len=30) + [system]
        check_all(hf, tokens(llm, batch, 6), llama_ckpt, batch, 6)
        assert_idle_everywhere(llm)

        outs = llm.generate(followups, greedy(4))
        assert [o.usage.cached_tokens for o in outs] == [48] * 3  # the system prompt's 12 pages, on both ranks
        check_all(hf, [o.token_ids for o in outs], llama_ckpt, followups, 4)

        held = llm.add_request(prompts(1, seed=6, max_len=30)[0] + [1], greedy(100))
        while not llm.request(held).output_ids:
            llm.step()
        llm.abort(held)
        while llm.has_unfinished():
            llm.step()
        assert_idle_everywhere(llm)
        again = prompts(2, seed=7, max_len=30)  # the aborted request's pages, reused
        check_all(hf, tokens(llm, again, 4), llama_ckpt, again, 4)

        os.kill(llm.workers.pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailed, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL"):
            llm.generate(again, greedy(4))
        assert time.monotonic() - start < 10
        with pytest.raises(WorkerFailed, match="rank 1"):  # and it stays down, clearly
            llm.check_health()


def test_sizes_that_do_not_divide_are_refused_before_any_rank_starts(llama_ckpt):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's attention heads \(4"):
        LLM(str(llama_ckpt), tensor_parallel_size=3)


def wait_ready(address: str, engine: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Until the engine answers a ping (each waits up to 0.5 s), or it exited, or `timeout` passed."""
    with EngineClient(address) as client:
        deadline = time.monotonic() + timeout
        while True:
            assert engine.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                client.ping(0.5)
                return
            except EngineUnavailable:
                continue


def test_serve_tp2_serves_and_exits_naming_a_killed_rank(llama_ckpt, hf, tmp_path):
    address = f"ipc://{tmp_path}/engine.sock"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "engine.service", "--address", address, "--model", str(llama_ckpt),
           "--device", "cpu", "--tp", "2"]
    with open(log, "wb") as out:
        engine = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(address, engine, log, 120)
        with EngineClient(address) as client:
            assert client.info().config["tensor_parallel_size"] == 2
            prompt = prompts(1, seed=8, max_len=30)[0]
            hf.check_greedy(client.complete(prompt, max_tokens=5, ignore_eos=True).token_ids, llama_ckpt, prompt, 5)
        (worker,) = children(engine.pid)
        os.kill(worker, signal.SIGKILL)
        assert engine.wait(10) == 1
        assert "tensor-parallel rank 1" in log.read_text() and "killed by SIGKILL" in log.read_text()
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL); scripts/gpu_check.sh runs it")
def test_two_gpus_over_nccl_match_transformers(llama_ckpt, hf):
    batch = prompts(4, seed=12, max_len=40)
    with LLM(str(llama_ckpt), device="cuda", tensor_parallel_size=2, max_prefill_tokens=16) as llm:
        check_all(hf, tokens(llm, batch, 5), llama_ckpt, batch, 5)
        assert_idle_everywhere(llm)


def children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]
