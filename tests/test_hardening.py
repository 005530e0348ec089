"""Issue 9: each attack found by the adversarial probe, replayed against a real engine process.

Every test ends the same way (`healthy`): the engine process is alive, a well-behaved client gets
the same greedy tokens it got before any attack, and the stats show every request slot and KV page
free again. Items 5, 10 and 11 need an engine started with a low open-file limit, a permissive umask
and an auth token: the `locked` engine. A seeded fuzz test closes the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import resource
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from transformers import AutoTokenizer

from engine import SamplingParams
from engine.service.client import AUTH_ENV, AsyncEngineClient, EngineClient, EngineError, EngineUnavailable
from engine.service.launcher import EngineHandle, is_engine_process, serve_command, start, stop_engine
from engine.service.protocol import Stats
from engine.tokenizer import apply_chat_template, max_prompt_chars
from tests.wire import pack, raw_dealer, reply, unpack

ENGINE = dict(num_pages=512, max_running_requests=4, max_prefill_tokens=64)
BUFFER = 64  # --client-buffer-messages: replies ZeroMQ queues for a client that does not read
STALL = 2.0  # --client-stall-seconds: how long the engine holds replies for a client that reads none of them
PROBE = [5, 6, 7, 8]


def idle(s: Stats) -> bool:
    return (not s.waiting and not s.running and all(h is None for h in s.slots) and s.pages.held == 0
            and s.pages.locked == 0 and s.pages.free + s.pages.cached == s.pages.total)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def served(long_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    runtime = tmp_path_factory.mktemp("rt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(runtime))
        handle = start(f"ipc://{runtime}/engine.sock", model=str(long_ckpt), client_buffer_messages=BUFFER,
                       client_stall_seconds=STALL, **ENGINE)
        yield handle
        handle.stop()
        assert handle.process is not None and handle.process.returncode == 0


@pytest.fixture(scope="module")
def baseline(served: EngineHandle) -> list[int]:
    """The greedy tokens for PROBE before any attack."""
    with served.client() as client:
        return client.complete(PROBE, max_tokens=8, ignore_eos=True).token_ids




def healthy(handle: EngineHandle, baseline: list[int], client: EngineClient | None = None) -> Stats:
    """The engine process lives, answers a fresh client correctly, and holds no slot or page."""
    assert handle.process is None or handle.process.poll() is None, "the engine process exited"
    with handle.client(timeout=20) as fresh:
        c = client or fresh
        assert c.ping(5).pid == handle.pid
        assert c.complete(PROBE, max_tokens=8, ignore_eos=True).token_ids == baseline
        return c.wait_stats(idle, timeout=20)


# -- 1-3: crashes from one message ---------------------------------------------------------------
def test_1_deeply_nested_frame_gets_an_error(served: EngineHandle, baseline: list[int], raw: zmq.Socket) -> None:
    raw.send(b"\x91" * 1000 + b"\x01")
    msg = reply(raw)
    assert (msg["type"], msg["code"], msg["rid"]) == ("error", "bad_message", None)
    nested_map = b"\x81\xa1a" * 5000 + b"\x01"  # {"a": {"a": ... 1}}: the rid salvage must survive it too
    raw.send(nested_map)
    assert reply(raw)["code"] == "bad_message"
    healthy(served, baseline)


def test_2_tiny_temperature_samples_like_greedy(served: EngineHandle, baseline: list[int], ops: EngineClient) -> None:
    for t in (1e-40, 3e-38, 5e-324):
        out = ops.complete(PROBE, max_tokens=8, ignore_eos=True, temperature=t, seed=1)
        assert out.token_ids == baseline, t
    for bad in (float("nan"), float("inf")):
        with pytest.raises(EngineError) as err:
            ops.complete(PROBE, temperature=bad)
        assert err.value.code == "invalid_params"
    with pytest.raises(ValueError, match="seed"):  # beyond what the wire can carry, but not the Python API
        SamplingParams(temperature=1.0, seed=2**70)
    healthy(served, baseline)


def test_3_tiny_top_p_keeps_the_top_token(served: EngineHandle, baseline: list[int], ops: EngineClient) -> None:
    out = ops.complete(PROBE, max_tokens=8, ignore_eos=True, temperature=1.0, top_p=5e-324, seed=3)
    assert out.token_ids == baseline
    with pytest.raises(EngineError) as err:
        ops.complete(PROBE, top_p=float("nan"))
    assert err.value.code == "invalid_params"
    healthy(served, baseline)


# -- 4: peers that choose the ids the ROUTER would assign ----------------------------------------
def test_4_chosen_routing_ids_do_not_abort_the_engine(served: EngineHandle, baseline: list[int]) -> None:
    ctx = zmq.Context.instance()
    squatters = []
    try:
        for k in range(40):  # libzmq's unseeded rand() made every engine's first peer id 00 6b8b4567
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, b"\x00" + struct.pack(">I", 0x6B8B4567 + k))
            s.connect(served.address)
            s.send(pack({"type": "ping", "nonce": k}))
            squatters.append(s)
        for k, s in enumerate(squatters):
            assert reply(s)["nonce"] == k
        for _ in range(3):  # ordinary (anonymous) clients connect after them
            healthy(served, baseline)
    finally:
        for s in squatters:
            s.close()


# -- 6-9: stalls and memory ----------------------------------------------------------------------
def test_6_stop_strings_are_capped_and_cheap(served: EngineHandle, baseline: list[int], ops: EngineClient) -> None:
    with pytest.raises(EngineError) as err:
        ops.complete(PROBE, stop=["ab"] * 250_000)  # 0.75 MB: under the message size limit
    assert err.value.code == "invalid_params" and "at most 16" in err.value.message
    with pytest.raises(EngineError, match="at most 16"):
        ops.complete(PROBE, stop=["x" * 257])
    # The largest allowed lists, on four requests at once, while a bystander decodes.
    full = ops.complete(PROBE, max_tokens=40, ignore_eos=True)
    stop = full.text[len(full.text) // 2:][:3]
    assert stop
    stops = [chr(0x4E00 + i) * 256 for i in range(15)] + [stop]
    rids = [ops.submit(PROBE, max_tokens=40, ignore_eos=True, stop=stops) for _ in range(4)]
    bystander = ops.complete(PROBE, max_tokens=40, ignore_eos=True)
    assert bystander.token_ids == full.token_ids
    for rid in rids:
        *_, final = ops.stream(rid)
        assert final.finish_reason == "stop"
    healthy(served, baseline)


def test_7_huge_prompts_do_not_stall_streams_or_pings(served: EngineHandle, baseline: list[int], long_ckpt: Path,
                                                      ops: EngineClient, raw: zmq.Socket) -> None:
    cap_chars = max_prompt_chars(AutoTokenizer.from_pretrained(long_ckpt), ops.info().max_seq_len)
    stream = ops.generate(PROBE, max_tokens=3000, ignore_eos=True)
    next(stream)
    # Ten ~0.96 MB prompts (refused before tokenizing) and six just under the character cap, which
    # the tokenizer worker must encode (~0.3 s each) before they are refused as too many tokens.
    huge = ["word " * 192_000] * 10 + [("word " * (cap_chars // 5))[: cap_chars - 10]] * 6
    for i, prompt in enumerate(huge):
        raw.send(pack({"type": "submit", "rid": f"huge-{i}", "prompt": prompt}))
    gaps, pings = [], []
    last = sent = time.monotonic()
    for _ in range(8):
        out = next(stream)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        t0 = time.monotonic()
        ops.ping(5)
        pings.append(time.monotonic() - t0)
    ops.abort(out.rid)  # now: it has done its part, and it would end by itself while the refusals are awaited
    *_, final = stream
    assert final.finish_reason == "abort"
    codes = {}
    for _ in huge:
        msg = reply(raw, timeout=60)
        codes[msg["rid"]] = msg["code"]
    backlog = time.monotonic() - sent  # what the tokenizer worker took for the six it encoded
    assert codes == {f"huge-{i}": "prompt_too_long" for i in range(len(huge))}
    # In the loop, tokenizing would hold pings and the stream for the whole backlog (12 s in the issue).
    # The bound is one second; on a loaded shared machine, allow a fraction of the backlog.
    assert max(pings) < max(1.0, backlog / 4), (pings, backlog)
    assert max(gaps) < max(1.0, backlog / 4), (gaps, backlog)
    healthy(served, baseline)


NOT_READING = {zmq.RCVHWM: 1, zmq.RCVBUF: 4096}
"""A raw client whose receive side holds almost nothing (one message, a 4 KiB socket buffer), so its engine-side
queue fills as soon as it stops reading."""


def test_8_a_client_that_never_reads_is_cut_off(served: EngineHandle, baseline: list[int],
                                                ops: EngineClient) -> None:
    with raw_dealer(served.address, NOT_READING) as slow:
        aborted = ops.stats().counters.aborted
        for i in range(4):
            slow.send(pack({"type": "submit", "rid": f"slow-{i}", "token_ids": PROBE,
                            "params": {"max_tokens": 8000, "ignore_eos": True}}))
        snap = ops.wait_stats(lambda s: s.counters.aborted >= aborted + 4 and idle(s), timeout=60)
        assert snap.counters.aborted == aborted + 4
        # Whichever comes first: STALL seconds with its queue full (64 replies beyond a 128 KiB socket buffer),
        # or it stops answering the transport heartbeat because its receive side is full.
        log = served.log_path.read_text()
        assert "it read none of its replies for 2 s" in log or "stopped reading and missed its heartbeats" in log
    healthy(served, baseline)


def test_8_a_client_that_reads_late_loses_nothing(served: EngineHandle, baseline: list[int],
                                                  ops: EngineClient) -> None:
    """A client busy for a while (hundreds of steps, far beyond its 64-reply queue, within STALL) keeps its
    request: the engine holds what the queue does not take, and the stream arrives whole and in order."""
    with raw_dealer(served.address, NOT_READING) as late:
        aborted = ops.stats().counters.aborted
        late.send(pack({"type": "submit", "rid": "late", "token_ids": PROBE,
                        "params": {"max_tokens": 2000, "ignore_eos": True}}))
        # not reading while the engine runs 400 steps: six times what its queue holds
        snap = ops.wait_stats(lambda s: any(r.rid == "late" and r.generated >= 400 for r in s.running)
                              or s.counters.aborted > aborted, timeout=60)
        assert snap.counters.aborted == aborted, "the engine dropped a client that was only busy"
        tokens: list[int] = []
        while True:
            msg = reply(late, timeout=30)
            assert msg["type"] == "outputs", msg
            for item in msg["items"]:
                tokens += item["token_ids"]
            if msg["items"][-1]["type"] == "final":
                break
        assert msg["items"][-1]["finish_reason"] == "length" and len(tokens) == 2000
        assert tokens[:8] == baseline  # greedy: the same start as any other client's, in order
    healthy(served, baseline)


SUBSCRIBER_HOG = """
import os, sys, zmq
ctx = zmq.Context()
socks = []
for i in range(8):
    s = ctx.socket(zmq.SUB)
    s.connect(sys.argv[1])
    s.setsockopt(zmq.SUBSCRIBE, bytes([i]) * (1 << 20))
    socks.append(s)
for i in range(50):
    socks[0].setsockopt(zmq.SUBSCRIBE, str(i).encode() * 5)  # many small distinct ones on one peer
print("subscribed", flush=True)
sys.stdin.read()
os._exit(0)  # libzmq may crash tearing down sockets whose subscriptions were refused: not the engine's concern
"""


def test_9_stats_subscriptions_are_capped(served: EngineHandle, baseline: list[int], ops: EngineClient) -> None:
    before = rss_mib(served.pid)
    hog = subprocess.Popen([sys.executable, "-c", SUBSCRIBER_HOG, served.address + ".stats"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline() == "subscribed\n"
        first = ops.stats().seq  # some snapshots later, the loop has read what the hog could send
        ops.wait_stats(lambda s: s.seq >= first + 5)
        assert rss_mib(served.pid) - before < 64  # was +385 MiB
    finally:
        hog.kill()
        hog.wait()
    healthy(served, baseline)


# -- 5, 10, 11: an engine with a low fd limit, a permissive umask and an auth token --------------
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def locked(long_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    root = tmp_path_factory.mktemp("locked")
    address = f"ipc://{root}/fresh/engine.sock"

    def limits() -> None:
        os.umask(0)
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    log = root / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(serve_command(address, str(long_ckpt), **ENGINE), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=limits, env={**os.environ, AUTH_ENV: TOKEN})
    handle = EngineHandle(address, proc.pid, proc, log, TOKEN)
    try:
        with handle.client() as client:
            end = time.monotonic() + 120
            while True:
                assert proc.poll() is None, log.read_text()
                try:
                    client.ping(0.5)
                    break
                except EngineUnavailable:
                    assert time.monotonic() < end, log.read_text()
        yield handle
    finally:
        handle.stop()


def test_11_sockets_are_owner_only_and_need_the_token(locked: EngineHandle, baseline: list[int]) -> None:
    path = Path(locked.address.removeprefix("ipc://"))
    for p in (path, Path(f"{path}.stats")):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, oct(p.stat().st_mode)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with EngineClient(locked.address, timeout=5, auth_token="wrong") as intruder:
        for _ in range(3):  # the first try meets the handshake; later ones a connection already refused
            with pytest.raises(EngineUnavailable, match="refused this client: wrong or missing auth token"):
                intruder.ping()

    async def async_intruder() -> None:
        async with AsyncEngineClient(locked.address, timeout=5, auth_token="wrong") as client:
            for _ in range(3):
                with pytest.raises(EngineUnavailable, match="refused this client: wrong or missing auth token"):
                    await client.ping()

    asyncio.run(async_intruder())
    wrong = {**os.environ, AUTH_ENV: "wrong"}
    status = subprocess.run([sys.executable, "-m", "tui.cli", "status", "--address", locked.address],
                            capture_output=True, text=True, timeout=60, env=wrong)
    assert status.returncode == 1 and "refused this client: wrong or missing auth token" in status.stderr
    squatter = subprocess.run([sys.executable, "-m", "tui.cli", "serve", "--address", locked.address],
                              capture_output=True, text=True, timeout=60, env=wrong)  # must not take the address
    assert squatter.returncode == 1 and "an engine already answers there" in squatter.stderr, squatter.stderr
    raw = zmq.Context.instance().socket(zmq.DEALER)  # no PLAIN handshake at all
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.SNDTIMEO, 1000)  # once the failed handshake drops the pipe, a DEALER has no peer to queue to
    raw.connect(locked.address)
    with contextlib.suppress(zmq.Again):
        raw.send(pack({"type": "submit", "rid": "sneak", "token_ids": PROBE}))
    assert not raw.poll(1000)
    raw.close()
    healthy(locked, baseline)


def test_5_idle_connections_cannot_exhaust_descriptors(locked: EngineHandle, baseline: list[int]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("this test process needs more than 1,100 descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    path = locked.address.removeprefix("ipc://")
    with locked.client(timeout=20) as existing:
        assert existing.ping(5).pid == locked.pid
        existing.stats()  # its stats connection too is made before the cap is reached
        idle_conns = []
        try:
            for _ in range(1014):  # was: libzmq aborts (Too many open files, ipc_listener.cpp)
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(path)
                except OSError:  # the listen backlog is full while the cap closes connections
                    s.close()
                    continue
                idle_conns.append(s)
            assert locked.process.poll() is None
            healthy(locked, baseline, existing)  # an existing client keeps being served at the cap
        finally:
            for s in idle_conns:
                s.close()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "connection cap" in locked.log_path.read_text()
    healthy(locked, baseline)


def test_10_stop_goes_through_the_protocol_and_never_kills_a_stranger(locked: EngineHandle,
                                                                      tmp_path: Path) -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=40000)
    stopping = threading.Event()

    def impostor() -> None:  # answers ping / info claiming the victim's pid, ignores shutdown
        while not stopping.is_set():
            if not fake.poll(50):
                continue
            ident, body = fake.recv_multipart()
            msg = unpack(body)
            if msg["type"] == "ping":
                fake.send_multipart([ident, pack({"type": "pong", "nonce": msg["nonce"], "version": "0",
                                                  "pid": victim.pid})])

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        address = f"tcp://127.0.0.1:{port}"
        assert not is_engine_process(victim.pid, address)
        with pytest.raises(RuntimeError, match="not signalling"):
            stop_engine(address, timeout=1.0)
        assert victim.poll() is None
    finally:
        stopping.set()
        thread.join()
        fake.close()
        victim.kill()
        victim.wait()
    # The real engine: verified, and stopped by the protocol's shutdown message.
    assert is_engine_process(locked.pid, locked.address)
    assert stop_engine(locked.address, timeout=20, auth_token=TOKEN) == locked.pid
    assert locked.process.wait(20) == 0
    assert not Path(locked.address.removeprefix("ipc://")).exists()


# -- smaller ones --------------------------------------------------------------------------------
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                   "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}")


def test_chat_roles_a_template_rejects_are_invalid_requests(long_ckpt: Path) -> None:
    tok = AutoTokenizer.from_pretrained(long_ckpt)
    tok.chat_template = STRICT_TEMPLATE  # like Qwen's and Llama's templates, which raise for unknown roles
    for role in ("", "tool", "\x00"):
        with pytest.raises(ValueError, match="refused these messages"):
            apply_chat_template(tok, [{"role": role, "content": "hi"}])


def test_duplicate_rid_is_refused_by_the_client(served: EngineHandle, baseline: list[int],
                                                                          ops: EngineClient) -> None:
    rid = ops.submit(PROBE, max_tokens=3000, ignore_eos=True)
    with pytest.raises(EngineError, match="duplicate_request"):
        ops.submit(PROBE, rid=rid)
    ops.abort(rid)
    assert list(ops.stream(rid))[-1].finish_reason == "abort"
    healthy(served, baseline)


def test_a_vanished_engine_is_noticed_at_once_not_at_the_timeout(tmp_path: Path) -> None:
    """The connection closing (the engine was killed) fails waiting calls at once, after what it sent."""
    address = f"ipc://{tmp_path}/dead.sock"
    ctx = zmq.Context.instance()

    def doomed_engine() -> zmq.Socket:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        return router

    router = doomed_engine()
    with EngineClient(address, timeout=30) as client:
        stream = client.generate(PROBE, rid="r", max_tokens=100)
        assert router.poll(5000)
        ident, _ = router.recv_multipart()
        delta = {"type": "delta", "rid": "r", "text": "a", "token_ids": [1]}
        router.send_multipart([ident, pack({"type": "outputs", "items": [delta]})])
        assert next(stream).text == "a"
        router.close()  # as a SIGKILL would
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable, match="closed the connection"):
            next(stream)
        assert time.monotonic() - t0 < 5

    async def async_side() -> None:
        router = doomed_engine()
        async with AsyncEngineClient(address, timeout=30) as client:
            waiter = asyncio.ensure_future(client.complete(PROBE, rid="a"))
            assert await asyncio.to_thread(router.poll, 5000)
            router.close()
            t0 = time.monotonic()
            with pytest.raises(EngineUnavailable, match="closed the connection"):
                await waiter
            assert time.monotonic() - t0 < 5

    asyncio.run(async_side())


# -- fuzz ----------------------------------------------------------------------------------------
def _fuzz_frames(rng: random.Random, n: int) -> list[list[bytes]]:
    """Valid-looking messages with mutated fields, random MessagePack, random bytes, deep nesting."""
    def value() -> object:
        return rng.choice([None, True, -1, 0, 2**63, -(2**63), 1e308, -1e-320, float("nan"), "",
                           "x" * rng.randint(1, 300), [1, 2], {"a": 1}, [[[[]]]], b"\x00\xff"])

    frames = []
    for i in range(n):
        kind = rng.randrange(6)
        if kind == 0:
            frames.append([bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))])
        elif kind == 1:
            frames.append([bytes([rng.choice([0x91, 0x81, 0xDC, 0xDE])]) * rng.randint(1, 3000) + b"\x01"])
        elif kind == 2:
            names = ["max_tokens", "temperature", "top_k", "top_p", "ignore_eos", "stop", "seed", "junk"]
            params = {k: rng.choice([value(), 1, 0.5]) for k in rng.sample(names, rng.randint(0, 4))}
            msg = {"type": "submit", "rid": rng.choice([f"fz-{i}", value()]), "params": params,
                   rng.choice(["prompt", "token_ids", "messages"]): rng.choice(
                       [value(), "hi", [5, 6], [{"role": "user", "content": "hi"}]])}
            if not isinstance(params.get("max_tokens"), int) or params["max_tokens"] > 2:
                params["max_tokens"] = 2  # a submit that happens to be valid finishes quickly
            frames.append([pack(msg)])
        elif kind == 3:
            frames.append([pack({"type": rng.choice(["abort", "ping", "get_info", "submit", "nope", 7]),
                                 rng.choice(["rid", "nonce", "x"]): value()})])
        elif kind == 4:
            good = pack({"type": "ping", "nonce": i})
            cut = rng.randrange(len(good))
            frames.append([good[:cut] + bytes([rng.randrange(256)]) + good[cut + 1:]])
        else:
            frames.append([pack({"type": "ping", "nonce": i})] * rng.randint(2, 3))
    return frames


def test_fuzzed_frames_are_each_answered(served: EngineHandle, baseline: list[int], raw: zmq.Socket,
                                         ops: EngineClient) -> None:
    rng = random.Random(9)
    started = time.monotonic()
    for frames in _fuzz_frames(rng, 300):
        raw.send_multipart(frames)
        msg = reply(raw)
        # a mutated submit that happened to be valid: read its outputs up to its final
        while msg["type"] == "outputs" and not any(item["type"] == "final" for item in msg["items"]):
            msg = reply(raw)
        assert msg["type"] in ("error", "pong", "info", "outputs", "aborted"), msg
    assert time.monotonic() - started < 60
    healthy(served, baseline)


# -- issue 25, item 4: chats that count as empty -------------------------------------------------------
def test_empty_message_floods_are_refused_and_one_client_cannot_hog_the_tokenizer(
        served: EngineHandle, baseline: list[int], ops: EngineClient, raw: zmq.Socket) -> None:
    """40,000 empty messages (0 characters by the prompt guard) are refused before any rendering; a
    client queueing more than its share of chats for the tokenizer is told to wait, and another
    client is served meanwhile."""
    raw.send(pack({"type": "submit", "rid": "flood", "messages": [{"role": "user", "content": ""}] * 40_000}))
    msg = reply(raw)
    assert (msg["code"], msg["rid"]) == ("prompt_too_long", "flood") and "40000 messages" in msg["message"]
    many = [{"role": "user", "content": ""}] * (ops.info().max_seq_len // 2)  # as many as may be rendered
    for i in range(72):
        raw.send(pack({"type": "submit", "rid": f"chat-{i}", "messages": many}))
    # a second caller on the same connection (as the HTTP front's callers are: its label names each) has a share
    raw.send(pack({"type": "submit", "rid": "other-caller", "messages": many[:2], "client": "http 127.0.0.2 POST",
                   "params": {"max_tokens": 1}}))
    assert ops.complete(PROBE, max_tokens=8, ignore_eos=True).token_ids == baseline  # someone else is served
    codes, other = [], None
    while len(codes) < 72 or other is None:
        msg = reply(raw, timeout=120)
        if msg["type"] == "error" and msg["rid"] != "other-caller":
            codes.append(msg)
        elif msg["type"] == "error" or any(item["type"] == "final" for item in msg.get("items", ())):
            other = msg
    waited = [m for m in codes if m["code"] == "overloaded"]
    assert len(waited) >= 4 and all("at most 64" in m["message"] for m in waited), codes
    assert other["type"] == "outputs", other  # served, not refused for the first caller's share
    healthy(served, baseline)
