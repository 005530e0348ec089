"""minichat replicas with the fleet tools people already run (issue 26): vllm-htop reads a replica's
`/metrics` by vLLM's names and reports the engine's own numbers; SGLang's gateway (`smg`) spreads requests
over two replicas (which do not sample in lockstep), sends requests that share a prefix to the replica
that cached it, and routes around a replica that was SIGKILLed mid-run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from engine.service.client import EngineClient, probe
from engine.service.protocol import Stats
from tests.test_process_faults import gone, wait_until
from tui.bench.fleet import Replica, gateway, replica, vllm_counters


def tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} is not installed (pip install '.[dev]' installs it)")
    return path


@pytest.fixture(scope="module")
def pair() -> Iterator[list[Replica]]:
    """Two demo-model replicas, shared by this module's tests (each takes seconds to start)."""
    with ExitStack() as stack:
        yield [stack.enter_context(replica()) for _ in range(2)]


@pytest.fixture(scope="module")
def smg() -> str:
    return tool("smg")


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def submitted(rep: Replica) -> int:
    """Requests the replica's engine has accepted so far."""
    with EngineClient(rep.address) as engine:
        return engine.stats().counters.submitted


def idle(s: Stats) -> bool:
    return not s.waiting and not s.running and all(h is None for h in s.slots) and s.pages.held == 0


def test_vllm_htop_reads_a_replica_as_minichat_status_does(pair):
    """htop reads while one request decodes: its numbers must lie between the engine's own stats read just
    before and just after it (the request's pages grow meanwhile). A request that ended before the second
    read leaves nothing to compare, and the check runs again with a new one."""
    htop = tool("vllm-htop")
    rep = pair[0]
    with EngineClient(rep.address) as engine:
        for _ in range(5):
            stream = sdk(rep.url).completions.create(model="demo_model", prompt="Once more unto the breach",
                                                     max_tokens=900, stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))  # it runs now
            try:
                before = engine.stats()
                report = subprocess.run([htop, "--url", rep.url, "--once", "--output", "json"],
                                        capture_output=True, text=True, timeout=60, check=True)
                after = engine.stats()
            finally:
                stream.close()
            engine.wait_stats(idle, 30)  # the closed stream's request is aborted before the next try or test
            if len(after.running) == 1:
                break
        else:
            pytest.fail("the request ended before htop had read the replica, five times")
        (row,) = json.loads(report.stdout.splitlines()[-1])["replicas"]
        assert row["status"] == "OK" and row["model"] == "demo_model"
        assert row["running"] == len(before.running) == len(after.running) == 1
        assert row["waiting"] == len(before.waiting) == len(after.waiting) == 0
        page = 100 / after.pages.total
        assert 100 * before.pages.usage - page <= row["kv_pct"] <= 100 * after.pages.usage + page, (before.pages,
                                                                                                    after.pages)
        assert row["lifetime"]["prompt_tokens_total"] is not None


def test_two_replicas_behind_smg_share_the_load_and_sample_apart(pair, smg):
    # unseeded sampling differs between replicas (each engine draws its own seed)
    texts = [sdk(r.url).completions.create(model="demo_model", prompt="To be, or not to be", max_tokens=24,
                                           temperature=1.0, extra_body={"ignore_eos": True}).choices[0].text
             for r in pair]
    assert texts[0] != texts[1]
    with gateway(smg, pair, "round_robin") as url:
        before = [submitted(r) for r in pair]
        client = sdk(url)
        for i in range(8):
            out = client.completions.create(model="demo_model", prompt=f"Speak, number {i}", max_tokens=4)
            assert out.choices[0].finish_reason in ("stop", "length")
        served = [submitted(r) - b for r, b in zip(pair, before, strict=True)]
        assert served == [4, 4]
        assert client.models.list().data[0].id == "demo_model"


# smg's cache_aware policy keeps a radix tree of the text it sent each worker and sends a request to the
# worker whose text matches the largest share of the request's, when that share exceeds --cache-threshold
# (else to the least loaded). Made deterministic here: a follow-up shares ~95% of its text with its group
# and ~0% with the others, so 0.5 separates them with room; the spill gate (leave the matched worker for
# the least loaded one when its load exceeds the mean by both balance thresholds) never opens; and the
# warm-up slice (route one miss in 4, and divert one hit in 8, to a worker whose tree is still thin) is
# off, since it would move a group's hits to the other replica on purpose.
CACHE_AWARE = ("--cache-threshold", "0.5", "--balance-abs-threshold", "1000000", "--balance-rel-threshold", "1000000",
               "--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0")


def test_cache_aware_smg_sends_a_shared_prefix_to_the_replica_that_cached_it(pair, smg):
    """Four groups of prompts, each group sharing a long prefix (distinct from the first character on):
    every group lands on one replica, whose prefix cache serves each follow-up its prefix, and each
    replica's `vllm:prefix_cache_hits` counter moves by what its requests report as cached."""
    prefixes = [f"{name}: " + " ".join(f"{name.lower()}{i}" for i in range(60))
                for name in ("Alpha", "Bravo", "Charlie", "Delta")]
    with gateway(smg, pair, "cache_aware", *CACHE_AWARE) as url:
        hits_before = [vllm_counters(r.url)["vllm:prefix_cache_hits_total"] for r in pair]
        client = sdk(url)
        landed: dict[int, set[int]] = {}
        cached = [0, 0]
        for turn in range(3):
            for group, prefix in enumerate(prefixes):
                before = [submitted(r) for r in pair]
                out = client.completions.create(model="demo_model", prompt=f"{prefix} Question {turn}?", max_tokens=2)
                (where,) = [i for i, (r, b) in enumerate(zip(pair, before, strict=True)) if submitted(r) > b]
                landed.setdefault(group, set()).add(where)
                usage = out.usage
                assert usage is not None and usage.prompt_tokens_details is not None
                hit = usage.prompt_tokens_details.cached_tokens or 0
                # first sight: nothing cached; then the prefix, in whole pages of 16 (~90% of the prompt)
                assert hit == 0 if turn == 0 else hit >= 0.8 * usage.prompt_tokens, (turn, group, hit, usage)
                cached[where] += hit
        assert all(len(replicas) == 1 for replicas in landed.values()), landed
        # the counters move with each request's Final, which the reply waited for
        hits = [vllm_counters(r.url)["vllm:prefix_cache_hits_total"] - b
                for r, b in zip(pair, hits_before, strict=True)]
        assert hits == cached and sum(hits) > 0


# What smg does when a worker dies (observed with smg 1.13): a stream it was relaying ends with an SSE error
# event ("Stream ended by the worker before completion", a 502 in its log), which the SDK raises as an
# APIError; a request whose response head had not come yet, or one sent to the dead worker afterwards,
# is retried on another worker (--retry-max-retries, 5 by default), so its client never sees the death.
# Each failure counts against the worker's circuit breaker; --cb-failure-threshold 1 opens it at the
# first, so new requests stop being tried on the victim at all. Health checks (every 60 s by default)
# play no part here. The test kills only once every stream is relaying, so each one's fate is fixed.
ROUTE_AROUND = ("--cb-failure-threshold", "1")


def stream(client: openai.OpenAI, i: int, relaying: threading.Event) -> str:
    """One streamed request of 1,000 tokens (of the demo model's 1,024), read to its end: "complete" when its last
    chunk carries a finish reason, else the SDK's error; one that ends quietly, a silently truncated reply, is
    "truncated". `relaying` is set once its first chunk is in: the gateway has its worker's response, and can no
    longer retry it. Read to the end, not for a number of chunks after the kill: a victim's stream may have many
    chunks still buffered on the way (a loaded machine's client reads behind), which would look like going on."""
    try:
        chunks = client.completions.create(model="demo_model", prompt=f"Request {i} reads", max_tokens=1000,
                                           stream=True, extra_body={"ignore_eos": True})
        with chunks:
            for chunk in chunks:
                relaying.set()
                if any(c.finish_reason for c in chunk.choices):
                    return "complete"
        return "truncated"
    except openai.APIError as e:
        return f"error: {e.message}"
    finally:
        relaying.set()


def test_smg_routes_around_a_sigkilled_replica(pair, smg):
    """12 streams over a survivor and a victim; once every one is relaying, the victim's `serve --http` is
    SIGKILLed (its engine child follows it). Every stream the survivor had completes, every one the victim had
    fails with an error (or had left it whole), none is cut short quietly; new requests all go to the survivor
    and complete; the survivor ends with every page and slot free."""
    survivor = pair[0]
    with replica() as victim, gateway(smg, [survivor, victim], "round_robin", *ROUTE_AROUND) as url:
        pong = probe(victim.address, 5.0)
        assert pong is not None
        before = submitted(survivor)
        client = sdk(url)
        relaying = [threading.Event() for _ in range(12)]
        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(stream, client, i, r) for i, r in enumerate(relaying)]
            assert all(r.wait(60) for r in relaying)
            victim.process.kill()
            outcomes = [f.result() for f in futures]
        assert victim.process.wait(30) == -9
        wait_until(lambda: gone(pong.pid), "the victim's engine to exit with its parent")
        assert all(o == "complete" or o.startswith("error: ") for o in outcomes), outcomes  # none cut quietly
        theirs = submitted(survivor) - before  # round robin: 6 each
        # the survivor's streams all complete; the victim's fail with an error, unless every chunk of one had left
        # the victim before the kill (then it completes: nothing was lost)
        assert theirs == 6 and outcomes.count("complete") >= theirs, outcomes
        before = submitted(survivor)
        for i in range(6):
            out = client.completions.create(model="demo_model", prompt=f"After {i}", max_tokens=4)
            assert out.choices[0].finish_reason in ("stop", "length")
        assert submitted(survivor) - before == 6
    with EngineClient(survivor.address) as engine:
        engine.wait_stats(idle, 30)
