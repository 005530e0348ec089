"""The engine process over real sockets: streaming, abort from another client, the documented raw
protocol, bad input, and clients that vanish. One engine subprocess serves the whole module."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from engine import LLM, SamplingParams
from engine.outputs import Delta, Final
from engine.pages import paint
from engine.service.client import EngineClient, EngineError
from engine.service.launcher import EngineHandle, start
from engine.service.protocol import Stats
from tests.wire import pack, reply

ROOT = Path(__file__).resolve().parent.parent
# Few slots, a 4-token prefill budget and a big KV pool: a long prompt stays mid-chunk for hundreds of
# steps (holding the whole budget, so whatever arrives next waits), and a request with a huge
# max_tokens keeps running until aborted.
ENGINE = dict(num_pages=512, max_running_requests=4, max_prefill_tokens=4)
MAX_WAITING = 40
MAX_TOKENS = 6
LONG_PROMPT = [(i * 7) % 380 + 2 for i in range(2000)]


@pytest.fixture(scope="module")
def served(long_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineHandle:
    runtime = tmp_path_factory.mktemp("rt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(runtime))  # keeps the engine's log out of the user's directory
        handle = start(f"ipc://{runtime}/engine.sock", model=str(long_ckpt), max_waiting_requests=MAX_WAITING,
                       **ENGINE)
        yield handle
        handle.stop()
        assert handle.process is not None and handle.process.returncode == 0




def idle(s: Stats) -> bool:
    """Nothing waiting or running, every slot free, every page free or (unlocked) cached."""
    return (not s.waiting and not s.running and all(h is None for h in s.slots) and s.pages.held == 0
            and s.pages.locked == 0 and s.pages.free + s.pages.cached == s.pages.total)


def state_of(s: Stats, rid: str) -> str | None:
    if any(w.rid == rid for w in s.waiting):
        return "waiting"
    return next((r.state for r in s.running if r.rid == rid), None)


PROMPTS: list = (
    [f"The quick brown fox {i}" for i in range(22)]
    + [[{"role": "user", "content": f"question number {i}"}] for i in range(5)]
    + [[(i * 13 + k) % 380 + 2 for k in range(3 + i)] for i in range(5)]
)


def test_32_concurrent_streams_match_in_process_llm(served: EngineHandle, long_ckpt: Path, ops: EngineClient) -> None:
    assert len(PROMPTS) == 32

    async def stream_all() -> list[list[Delta | Final]]:
        async with served.async_client() as client:
            async def one(prompt: object) -> list[Delta | Final]:
                return [out async for out in client.generate(prompt, max_tokens=MAX_TOKENS)]
            return await asyncio.gather(*(one(p) for p in PROMPTS))

    results = asyncio.run(stream_all())
    ttfts = ops.wait_stats(idle).ttfts  # the engine's own TTFTs of recent first tokens, for dashboards
    assert {outs[-1].timings.ttft for outs in results} <= set(ttfts)
    expected = LLM(str(long_ckpt), **ENGINE).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    for outs, exp in zip(results, expected, strict=True):
        *deltas, final = outs
        assert all(isinstance(d, Delta) for d in deltas) and isinstance(final, Final)
        assert "".join(o.text for o in outs) == exp.text
        assert [t for o in outs for t in o.token_ids] == exp.token_ids
        assert final.finish_reason == exp.finish_reason
        assert final.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert final.usage.completion_tokens == len(exp.token_ids)
        t = final.timings
        assert t.queue is not None and t.ttft is not None and 0 <= t.queue <= t.ttft <= t.total

    snap = ops.wait_stats(idle)
    assert snap.counters.finished >= 32 and snap.counters.prefill_tokens > 0 and snap.counters.decode_tokens > 0
    assert snap.steps and {s.kind for s in snap.steps} <= {"prefill", "decode", "mixed"}


def test_abort_waiting_chunked_and_running_from_another_client(served: EngineHandle, ops: EngineClient) -> None:
    with served.client() as owner:
        running = owner.submit([5, 6, 7], max_tokens=3000, ignore_eos=True)
        ops.wait_stats(lambda s: state_of(s, running) == "running")
        chunked = owner.submit(LONG_PROMPT, max_tokens=4)
        ops.wait_stats(lambda s: state_of(s, chunked) == "prefilling")
        waiting = owner.submit("this one has to wait", max_tokens=4)
        snap = ops.wait_stats(lambda s: [state_of(s, r) for r in (running, chunked, waiting)]
                              == ["running", "prefilling", "waiting"])
        assert {running, chunked} <= set(snap.slots) and waiting not in snap.slots
        assert set(paint(snap.pages.total, snap.pages.runs, snap.pages.owners)[1]) == {"", running, chunked}
        progress = next(r for r in snap.running if r.rid == chunked)
        assert 0 < progress.prefilled < progress.prompt_tokens == len(LONG_PROMPT)

        for rid in (waiting, chunked, running):
            ops.abort(rid)
        for rid in (waiting, chunked, running):
            *_, final = owner.stream(rid)
            assert isinstance(final, Final) and final.finish_reason == "abort"
        assert final.usage.completion_tokens > 0

    snap = ops.wait_stats(idle)
    assert snap.counters.aborted >= 3
    with pytest.raises(EngineError) as err:
        ops.abort(running)
    assert err.value.code == "unknown_request"


def test_requests_are_labelled_by_client_and_described(served: EngineHandle, ops: EngineClient) -> None:
    """Stats name who sent each request (the client's label, else "client N"); `describe` tells all about
    one, its output a piece at a time; once it is gone it is described as gone, and aborting it then is
    answered but not counted as an error."""
    with served.client(name="nightly eval") as named, served.client() as anonymous:
        named.submit([5, 6, 7], max_tokens=3000, ignore_eos=True, rid="labelled")
        named.submit([8, 9], max_tokens=3000, ignore_eos=True, rid="relabelled", client="console tab 3")
        anonymous.submit("Once more unto the breach", max_tokens=3000, ignore_eos=True, rid="anonymous",
                         temperature=0.5, priority=2)
        rids = ("labelled", "relabelled", "anonymous")
        snap = ops.wait_stats(lambda s: all(state_of(s, rid) == "running" for rid in rids))
        clients = {e.rid: e.client for e in [*snap.waiting, *snap.running]}
        assert clients["labelled"] == "nightly eval" and clients["relabelled"] == "console tab 3"
        assert re.fullmatch(r"client \d+", clients["anonymous"]), clients

        deadline = time.monotonic() + 60
        while (d := ops.describe("anonymous")).output_chars < 8:
            assert time.monotonic() < deadline, d
        assert (d.state, d.client, d.slot is not None, d.reason) == ("running", clients["anonymous"], True, "")
        assert d.params is not None and (d.params.temperature, d.params.priority, d.params.max_tokens) == (0.5, 2, 3000)
        assert "unto the breach" in d.prompt_head and d.prompt_tail == "" and d.prompt_tokens > 0
        assert d.pages > 0 and d.generated > 0 and d.max_tokens == 3000 and d.choices == 1
        assert d.queue is not None and d.ttft is not None and 0 <= d.queue <= d.ttft <= d.age
        assert len(d.output) == d.output_chars
        more = ops.describe("anonymous", text_from=d.output_chars)
        assert more.output_chars >= d.output_chars and len(more.output) == more.output_chars - d.output_chars
        # the choices of a request with n > 1 are rows of their own ("pair#1"), described under that id
        named.submit([4, 5], max_tokens=3000, ignore_eos=True, rid="pair", n=2)
        ops.wait_stats(lambda s: state_of(s, "pair#1") is not None)
        assert (ops.describe("pair#1").rid, ops.describe("pair#1").choices, ops.describe("pair").choices) == \
            ("pair#1", 2, 2)
        ops.abort("pair")
        assert list(named.stream("pair"))[-1].finish_reason == "abort"

        errors = ops.stats().counters.errors
        for rid in rids:
            ops.abort(rid)
        assert list(anonymous.stream("anonymous"))[-1].finish_reason == "abort"
        for rid in rids[:2]:
            assert list(named.stream(rid))[-1].finish_reason == "abort"
        gone = ops.describe("anonymous")
        assert gone.state == "gone" and gone.params is None and gone.output == ""
        with pytest.raises(EngineError, match="unknown_request"):
            ops.abort("anonymous")  # it ended before the abort came: answered, and nobody's error
        assert ops.wait_stats(idle).counters.errors == errors


def test_raw_pyzmq_client_from_protocol_doc(served: EngineHandle, tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    script = tmp_path / "raw_client.py"
    script.write_text(re.search(r"## A raw client.*?```python\n(.*?)```", doc, re.S).group(1))
    out = subprocess.run([sys.executable, str(script), served.address], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert f"pong from pid {served.pid}" in out
    assert re.search(r"^final (stop|length) \{'prompt_tokens'", out, re.M)
    assert "r2 started: delta" in out and "r2 final abort" in out
    assert re.search(r"^stats: \d+ waiting, \d+ running, pages [.RcL]+$", out, re.M)


def submit(rid: str | None = "bad", **fields: object) -> bytes:
    msg = {"type": "submit", "rid": rid, "prompt": "hi", **fields}
    return pack({k: v for k, v in msg.items() if v is not None})


BAD = [
    ([b"\xc1 not msgpack"], "bad_message", None),
    ([b""], "bad_message", None),
    ([pack([1, 2, 3])], "bad_message", None),
    ([pack({"type": "launch_missiles"})], "bad_message", None),
    ([pack({"type": "submit", "prompt": "hi"})], "bad_message", None),
    ([submit(params={"max_tokens": "many"})], "bad_message", "bad"),
    ([submit(params={"max_token": 4})], "bad_message", "bad"),
    ([submit(temperature=0.5)], "bad_message", "bad"),
    ([submit(prompt=None, messages=[{"role": "user"}])], "bad_message", "bad"),
    ([submit(rid=None), submit()], "bad_message", None),
    ([submit(rid="")], "invalid_request", ""),
    ([submit(rid="x" * 300)], "invalid_request", "x" * 300),
    ([submit(prompt=None)], "invalid_request", "bad"),
    ([submit(token_ids=[1, 2])], "invalid_request", "bad"),
    ([submit(prompt="")], "invalid_request", "bad"),
    ([submit(prompt=None, token_ids=[])], "invalid_request", "bad"),
    ([submit(prompt=None, token_ids=[1, 999_999])], "invalid_request", "bad"),
    ([submit(prompt=None, token_ids=[-1])], "invalid_request", "bad"),
    ([submit(prompt=None, token_ids=[7] * 9000)], "prompt_too_long", "bad"),
    ([submit(params={"max_tokens": -1})], "invalid_params", "bad"),
    ([submit(params={"n": 0})], "invalid_params", "bad"),
    ([submit(params={"logit_bias": {"5": 1.0}})], "bad_message", "bad"),
    ([submit(params={"logit_bias": {5: 101.0}})], "invalid_params", "bad"),
    ([submit(prompt=None, token_ids=[1, 2], params={"logit_bias": {999_999: 1.0}})], "invalid_request", "bad"),
    ([submit(params={"temperature": -1.0})], "invalid_params", "bad"),
    ([submit(params={"top_p": 0.0})], "invalid_params", "bad"),
    ([submit(params={"top_k": 0})], "invalid_params", "bad"),
    ([submit(params={"stop": [""]})], "invalid_params", "bad"),
    ([submit(client="")], "invalid_request", "bad"),
    ([submit(client="x" * 129)], "invalid_request", "bad"),
    ([pack({"type": "abort", "rid": "nobody"})], "unknown_request", "nobody"),  # answered, not counted
]


def test_bad_input_gets_error_replies_and_the_engine_keeps_serving(served: EngineHandle, ops: EngineClient,
                                                                  raw: zmq.Socket) -> None:
    errors_before = ops.stats().counters.errors
    for frames, code, rid in BAD:
        raw.send_multipart(frames)
        msg = reply(raw)
        assert (msg["type"], msg["code"], msg["rid"]) == ("error", code, rid), (frames, msg)
        assert msg["message"]

    # A duplicate request id, while the first one is live.
    with served.client() as owner:
        first = owner.submit([5, 6, 7], max_tokens=3000, ignore_eos=True, rid="dup")
        ops.wait_stats(lambda s: state_of(s, first) == "running")
        raw.send(submit(rid="dup"))
        assert reply(raw)["code"] == "duplicate_request"
        ops.abort("dup")
        assert list(owner.stream("dup"))[-1].finish_reason == "abort"

    # Over capacity: hold the prefill budget with a mid-chunk prompt, fill the waiting queue, one more.
    held = ops.submit(LONG_PROMPT, max_tokens=1)
    ops.wait_stats(lambda s: state_of(s, held) == "prefilling")
    queued = [ops.submit("queued", max_tokens=1) for _ in range(MAX_WAITING)]
    ops.wait_stats(lambda s: len(s.waiting) == MAX_WAITING)
    raw.send(submit(rid="one-too-many"))
    assert reply(raw)["code"] == "overloaded"
    for rid in [*queued, held]:  # the queue first: once `held` is gone, the queue moves
        ops.abort(rid)

    # A frame over --max-message-bytes is refused, naming its request, and never becomes one (only frames
    # over four times the limit make ZeroMQ drop the connection).
    raw.send(submit(rid="huge", prompt="x" * (2 << 20)))
    msg = reply(raw, timeout=30)
    assert (msg["type"], msg["code"], msg["rid"]) == ("error", "too_large", "huge")
    # every refusal but the abort of nobody (a race any operator can lose), plus the duplicate and the overload
    assert ops.wait_stats(idle).counters.errors >= errors_before + len(BAD) - 1 + 2
    with pytest.raises(EngineError, match="unknown_request"):
        ops.abort("huge")
    assert ops.complete("still serving?", max_tokens=3).usage.completion_tokens >= 1


CLIENT = """
import sys
import time
from engine.service.client import EngineClient

client = EngineClient(sys.argv[1])
prefix, streaming = sys.argv[2], int(sys.argv[3])
print("started", flush=True)
sys.stdin.readline()
rids = [client.submit([5, 6, 7], max_tokens=4000, ignore_eos=True, rid=f"{prefix}-{i}") for i in range(3)]
streams = [client.stream(rid) for rid in rids[:streaming]]
for s in streams:
    next(s)
print("ready", flush=True)
sys.stdin.read()
"""


def run_and_kill_client(ops: EngineClient, address: str, prefix: str, streaming: int, states: list[str],
                        first: Callable[[], object] = lambda: None) -> None:
    """A client process submits three long requests and reads `streaming` of them; once the stats show
    them in `states`, it is killed. `first` runs once the process has started and before it submits (so a
    request `first` submits does not spend its life waiting for an interpreter to start)."""
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, address, prefix, str(streaming)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "started\n"
        first()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "ready\n"
        ops.wait_stats(lambda s: [state_of(s, f"{prefix}-{i}") for i in range(3)] == states)
    finally:
        proc.kill()
        proc.wait()


def test_killed_client_has_its_requests_aborted_and_resources_freed(ops: EngineClient, served: EngineHandle) -> None:
    aborted_before = ops.stats().counters.aborted
    # Two of them hold the KV pool's whole capacity estimate, so the third waits.
    run_and_kill_client(ops, served.address, "victim", 2, ["running", "running", "waiting"])
    snap = ops.wait_stats(idle, timeout=15)
    assert snap.counters.aborted >= aborted_before + 3
    assert ops.complete("after the crash", max_tokens=2).finish_reason in ("stop", "length")


def test_vanished_client_with_only_waiting_requests_is_caught_by_heartbeat(ops: EngineClient,
                                                                          served: EngineHandle) -> None:
    # `held` reserves ~500 of the 512 KV pages for as long as it lives (a few thousand steps), so nothing
    # queued behind it can be admitted: the queue cannot move on its own.
    held = ""

    def submit_held() -> None:
        nonlocal held
        held = ops.submit(LONG_PROMPT, max_tokens=6000, ignore_eos=True)
        ops.wait_stats(lambda s: state_of(s, held) is not None)

    run_and_kill_client(ops, served.address, "queued", 0, ["waiting"] * 3, first=submit_held)
    # Nothing was ever sent to them, so only the heartbeat can notice; `held` still being live shows
    # they left the queue by being aborted, not admitted.
    ops.wait_stats(lambda s: not s.waiting and state_of(s, held) is not None, timeout=15)
    ops.abort(held)
    ops.wait_stats(idle)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_engine_without_stats_subscribers_does_not_spin(served: EngineHandle) -> None:
    # Once nobody subscribes, no snapshot is due, so the loop must block on its sockets; a loop that
    # polls with a ~1 ms timeout instead burns a whole core and starves everything else on the machine.
    with served.client() as client:
        client.wait_stats(idle)
    assert served.process is not None
    before, start = cpu_seconds(served.process.pid), time.monotonic()
    time.sleep(2.0)  # a measurement window, not synchronisation
    used = cpu_seconds(served.process.pid) - before
    assert used < 0.25 * (time.monotonic() - start), f"idle engine used {used:.2f} s of CPU in 2 s"
