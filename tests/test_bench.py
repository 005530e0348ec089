"""`minichat bench` end to end: a real engine subprocess, the real CLI, and its JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from engine.service.client import EngineClient
from engine.service.launcher import start
from tui.bench.command import Machine, load_warning
from tui.bench.workload import make_workload

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def minichat(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tui.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def engine_address(llama_ckpt):
    address = f"ipc://{tempfile.mkdtemp(prefix='mcb')}/engine.sock"
    with start(address, model=str(llama_ckpt), timeout=60) as handle:
        yield handle.address


def submitted(address: str) -> int:
    """Requests the engine has accepted so far, from its stats stream."""
    with EngineClient(address) as client:
        return client.stats().counters.submitted


def test_short_bench_reports_every_metric_and_valid_json(engine_address, tmp_path):
    out = tmp_path / "bench.json"
    before = submitted(engine_address)
    run = minichat("bench", "--address", engine_address, "--num-requests", "6", "--concurrency", "3",
                   "--input-len", "20", "--output-len", "5", "--range-ratio", "0.5", "--warmup", "1",
                   "--json", str(out))
    assert run.returncode == 0, run.stderr
    for label in ("completed / aborted / failed", "request throughput", "output throughput", "total throughput",
                  "peak concurrency", "TTFT", "TPOT", "ITL", "E2E"):
        assert label in run.stdout and label not in run.stderr  # results on stdout: `bench > out` keeps them
    # progress on stderr, a bar each: the warm-up's one request, then the six measured
    assert "warmup: 100%" in run.stderr and "1/1" in run.stderr and "bench: 100%" in run.stderr \
        and "6/6" in run.stderr and "/7" not in run.stderr
    assert "cache: warm: attached to a running engine" in run.stderr
    report = json.loads(out.read_text())
    assert report["config"]["engine_execution"]["attention_backend"] == "cpu"  # what the run really used
    engine = report["engine"]
    assert engine["completed"] == 6 and engine["aborted"] == engine["failed"] == 0
    assert len(report["records"]) == 6
    assert submitted(engine_address) - before == 6 + 1  # the warm-up request runs once, unmeasured
    assert engine["peak_concurrency"] == 3
    outputs = sum(r["output_len"] for r in report["records"])
    assert engine["output_throughput"] == pytest.approx(outputs / engine["duration"])
    for r in report["records"]:
        assert 10 <= r["prompt_len"] <= 30 and r["error"] is None
        assert len(r["itl"]) == r["output_len"] - 1
        assert 0 < r["ttft"] <= r["e2e"]
    for m in METRICS:
        d = engine[m]
        assert 0 < d["median"] <= d["p99"] and d["mean"] > 0, m


def test_hf_baseline_runs_the_same_workload(engine_address, tmp_path):
    out = tmp_path / "bench.json"
    run = minichat("bench", "--address", engine_address, "--num-requests", "4", "--concurrency", "2",
                   "--input-len", "12", "--output-len", "4", "--warmup", "0", "--baseline", "hf", "--json", str(out))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["baseline"]["completed"] == 4
    assert sum(r["output_len"] for r in report["records"]) == 16
    assert report["baseline"]["output_throughput"] == pytest.approx(16 / report["baseline"]["duration"])
    assert report["ratio_output_throughput"] == pytest.approx(
        report["engine"]["output_throughput"] / report["baseline"]["output_throughput"])
    assert "engine / baseline" in run.stdout
    # how busy the machine was as it began, and, when it was, a word on what that does to this ratio
    machine = report["machine"]
    assert machine["cpus"] == len(os.sched_getaffinity(0)) and machine["load_average_1m"] >= 0
    assert machine["busy"] == (machine["load_average_1m"] > machine["cpus"])
    assert ("this machine is busy" in run.stderr) == ("measured on a busy machine" in run.stdout) \
        == machine["busy"], run.stderr


def test_a_busy_machine_is_said_before_the_numbers() -> None:
    """A load average above the CPUs: the benchmark says so, and what it does to a comparison; at or under
    them, nothing."""
    warning = load_warning(Machine(load_average_1m=5.3, cpus=2, busy=True))
    assert warning is not None and "load average (5.3) exceeds its 2 CPUs" in warning
    assert "a ratio between runs (or against --baseline) measures the load as much as the engines" in warning
    assert load_warning(Machine(load_average_1m=1.9, cpus=2, busy=False)) is None


def test_a_bench_that_starts_its_engine_measures_from_a_cold_cache(llama_ckpt, tmp_path):
    """Its prompts are the same every run (one seed), and the disk KV tier outlives an engine: a bench that starts
    its engine gives it an empty tier of its own, so a run after a warm one reads nothing from cache, and says so;
    --warm-cache keeps the user's tier, from which the same workload then comes back (the control)."""
    env = {**os.environ, "MINICHAT_KV_CACHE_DIR": str(tmp_path / "user-kv")}

    def run(name: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
        out = tmp_path / f"{name}.json"
        done = subprocess.run([sys.executable, "-m", "tui.cli", "bench", "--model", str(llama_ckpt), "--address",
                               f"ipc://{tmp_path}/{name}.sock", "--num-requests", "4", "--concurrency", "2",
                               "--input-len", "40", "--output-len", "2", "--warmup", "0", "--json", str(out), *extra],
                              capture_output=True, text=True, timeout=180, env=env)
        assert done.returncode == 0, done.stderr
        return done, json.loads(out.read_text())

    first, _ = run("first", "--warm-cache")
    assert "cache: warm on purpose (--warm-cache)" in first.stderr
    cold, report = run("cold")
    assert "cache: cold: an empty disk tier of this run's own" in cold.stderr
    assert report["config"]["cache"].startswith("cold") and report["engine"]["cached_prompt_tokens"] == 0
    own = Path(report["config"]["cache"].split("own (", 1)[1].split(", removed after)")[0])
    assert own.name.startswith("minichat-bench-kv-") and not own.exists()  # gone with its engine
    _, again = run("again", "--warm-cache")
    assert again["engine"]["cached_prompt_tokens"] > 0  # the user's tier had the pages the cold run did not read


def test_no_engine_fails_fast_with_a_clear_message():
    address = f"ipc://{tempfile.mkdtemp(prefix='mcb')}/nobody.sock"
    run = minichat("bench", "--address", address, "--num-requests", "2", timeout=30)
    assert run.returncode == 2
    assert f"no engine answers at {address}" in run.stderr
    assert "Traceback" not in run.stderr


def test_shared_prefix_workload_is_token_exact_and_the_cache_serves_the_prefixes(engine_address, tmp_path):
    """--prefix-len/--num-prefixes: every prompt is one of the prefixes plus its own suffix, exactly that many
    tokens; one at a time, each prefix misses once and then comes from the prefix cache, and the report says
    how much did (the engine's `cached_tokens`)."""
    prefixes = make_workload(list(range(100, 200)), 6, 8, 2, 0.0, seed=3, prefix_len=32, num_prefixes=2)
    assert len({tuple(r.prompt_ids[:32]) for r in prefixes}) == 2 and all(len(r.prompt_ids) == 40 for r in prefixes)
    assert [r.prompt_ids[32:] for r in prefixes] == [r.prompt_ids for r in make_workload(list(range(100, 200)), 6, 8,
                                                                                         2, 0.0, seed=3)]
    out = tmp_path / "bench.json"
    run = minichat("bench", "--address", engine_address, "--num-requests", "6", "--concurrency", "1", "--input-len",
                   "8", "--output-len", "2", "--prefix-len", "32", "--num-prefixes", "2", "--warmup", "0",
                   "--json", str(out))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["config"]["prefix_len"] == 32 and [r["prompt_len"] for r in report["records"]] == [40] * 6
    assert report["engine"]["input_tokens"] == 240
    assert report["engine"]["cached_prompt_tokens"] == 4 * 32  # whole pages of 16: the prefixes, not a suffix
    assert "prompt tokens from the prefix cache" in run.stdout and "128 of 240 (53%)" in run.stdout


def test_bad_options_are_refused(engine_address):
    run = minichat("bench", "--address", engine_address, "--range-ratio", "1.5")
    assert run.returncode == 2 and "--range-ratio must be in [0, 1)" in run.stderr


def test_a_request_an_operator_aborts_is_counted_aborted(long_ckpt: Path, tmp_path: Path) -> None:
    """Two long requests; a second client (an operator) aborts one while both run: the report counts one
    completed and one aborted (not two completed), leaves the aborted one out of the figures, and the
    exit status is 3."""
    out = tmp_path / "bench.json"
    address = f"ipc://{tmp_path}/engine.sock"
    with start(address, model=str(long_ckpt), timeout=120), EngineClient(address) as operator:
        bench = subprocess.Popen([sys.executable, "-m", "tui.cli", "bench", "--address", address, "--num-requests",
                                  "2", "--concurrency", "2", "--input-len", "16", "--output-len", "1500",
                                  "--warmup", "0", "--json", str(out)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            both = operator.wait_stats(lambda s: len(s.running) == 2 and all(r.generated for r in s.running), 120)
            victim = both.running[0].rid
            operator.abort(victim)
            stdout, stderr = bench.communicate(timeout=300)
        finally:
            bench.kill()
    assert bench.returncode == 3, stderr
    assert "completed / aborted / failed" in stdout and "1 / 1 / 0" in stdout
    assert "1 request was aborted by someone else" in stdout
    report = json.loads(out.read_text())
    assert (report["engine"]["completed"], report["engine"]["aborted"], report["engine"]["failed"]) == (1, 1, 0)
    records = report["records"]
    assert sorted(r["aborted"] for r in records) == [False, True] and all(r["error"] is None for r in records)
    completed = next(r for r in records if not r["aborted"])
    assert completed["output_len"] == 1500
    assert report["engine"]["output_throughput"] == pytest.approx(1500 / report["engine"]["duration"])
