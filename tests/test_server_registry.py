"""The server's request registry (engine/service/registry.py) through a real EngineServer, driven pass by pass
in this process: one record per live request through submit, tokenizing, an abort while tokenizing, a client
that vanishes, finishing and shutdown, and never an id left behind in the registry or the engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from engine import LLM, SamplingParams
from engine.service import protocol
from engine.service.options import ServerOptions
from engine.service.server import EngineServer
from engine.service.sockets import Sockets
from tests.checkpoints import UNTIL_ABORTED
from tests.wire import raw_dealer


@pytest.fixture
def server(long_ckpt: Path, tmp_path: Path) -> Iterator[EngineServer]:
    options = ServerOptions(address=f"ipc://{tmp_path}/engine.sock")
    assert options.address is not None
    sockets = Sockets(options.address, options)
    llm = LLM(str(long_ckpt), max_running_requests=4)
    try:
        yield EngineServer(llm, sockets, options)
    finally:
        llm.close()
        sockets.close(linger=0)


@pytest.fixture
def gate(server: EngineServer, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds every text prompt on the tokenizer worker until set (token ids pass straight through)."""
    opened = threading.Event()
    encode = server.llm.encode_prompt

    def held(prompt: object, tools: object = None, template_kwargs: object = None) -> list[int]:
        if isinstance(prompt, str):
            assert opened.wait(30), "the test never opened the gate"
        return encode(prompt, tools, template_kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(server.llm, "encode_prompt", held)
    yield opened
    opened.set()  # let the worker go, whatever the test did


def submit(sock: zmq.Socket, rid: str, **fields: object) -> None:
    params = SamplingParams(max_tokens=fields.pop("max_tokens", 4), ignore_eos=True)  # type: ignore[arg-type]
    sock.send(protocol.encode(protocol.Submit(rid=rid, params=params, **fields)))  # type: ignore[arg-type]


def read(sock: zmq.Socket, inbox: list[msgspec.Struct]) -> list[msgspec.Struct]:
    """`inbox` with every message waiting on `sock` added, heartbeats left out."""
    while sock.poll(0):
        msg = protocol.decode_engine(sock.recv())
        if not isinstance(msg, protocol.Heartbeat):
            inbox.append(msg)
    return inbox


def errors(inbox: list[msgspec.Struct]) -> list[str]:
    return [m.code for m in inbox if isinstance(m, protocol.Error)]


def finals(inbox: list[msgspec.Struct]) -> dict[str, str]:
    return {item.rid: item.finish_reason for m in inbox if isinstance(m, protocol.Outputs)
            for item in m.items if item.finished}


def until(server: EngineServer, done: Callable[[], bool], seconds: float = 60.0) -> None:
    """Run the server's loop pass by pass until `done`, checking the registry after every pass. Bounded by
    time, not passes: a busy pass is one tiny step (under a millisecond), while what the test waits for (a
    worker's tokenizing, a vanished client found by a failed send) takes wall time, more on a loaded machine."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        server.run_once()
        assert_one_record_per_live_request(server)
        if done():
            return
    pytest.fail("the server never got there")


RIDS = ("ids", "text", "bob-ids", "bob-text", "text2", "last", "last-text")


def assert_one_record_per_live_request(server: EngineServer) -> None:
    """Every request the engine knows has its record, and every record is either preparing (then only the
    server knows it, and its client is there) or in the engine."""
    snap = server.llm.stats()
    in_engine = {e.rid for e in (*snap.waiting, *snap.running)} | {r for r in RIDS if server.llm.request(r) is not None}
    records = {r.rid: r for r in server.requests}
    assert in_engine <= set(records)
    for rid, record in records.items():
        assert (server.llm.request(rid) is None) == (record.preparation is not None), rid
        assert record.preparation is None or record.owner is not None, rid


def test_one_record_per_live_request_from_submit_to_final(server: EngineServer, gate: threading.Event) -> None:
    address, inbox = server.sockets.address, []
    with raw_dealer(address) as alice, raw_dealer(address) as bob:
        submit(alice, "ids", token_ids=[5, 6, 7], max_tokens=UNTIL_ABORTED)  # running until aborted
        submit(alice, "text", prompt="held on the tokenizer worker")
        until(server, lambda: len(server.requests) == 2)
        text = server.requests.get("text")
        assert text is not None and text.preparation is not None and text.preparation.stage == "tokenizing"
        assert server.llm.request("text") is None and server.llm.request("ids") is not None

        for rid in ("ids", "text"):  # a rid is taken whatever stage its request is at
            submit(alice, rid, token_ids=[1])
        until(server, lambda: len(errors(read(alice, inbox))) == 2)
        assert errors(inbox) == ["duplicate_request"] * 2

        alice.send(protocol.encode(protocol.Abort(rid="text")))  # while tokenizing: its Final comes at once
        until(server, lambda: "text" in finals(read(alice, inbox)))
        assert "text" not in server.requests and finals(inbox) == {"text": "abort"}

        submit(bob, "bob-ids", token_ids=[8, 9], max_tokens=UNTIL_ABORTED)
        submit(bob, "bob-text", prompt="queued behind the held one")
        until(server, lambda: {"bob-ids", "bob-text"} <= {r.rid for r in server.requests})
        bob.close()  # bob vanishes: a send to him fails, and his requests are aborted
        until(server, lambda: "bob-text" not in server.requests)
        until(server, lambda: "bob-ids" not in server.requests)  # kept, ownerless, until the engine's Final
        assert server.llm.request("bob-ids") is None and server.llm.describe("bob-ids") is None

        gate.set()
        submit(alice, "text2", prompt="tokenized at last", max_tokens=3)
        until(server, lambda: "text2" in finals(read(alice, inbox)))
        alice.send(protocol.encode(protocol.Abort(rid="ids")))
        # the record goes when the Final is sent; alice's socket has it a moment later
        until(server, lambda: not server.requests and "ids" in finals(read(alice, inbox)))
        assert finals(inbox) == {"text": "abort", "ids": "abort", "text2": "length"}
        assert not server.llm.has_unfinished() and server.llm.stats().idle

        submit(alice, "last", token_ids=[3, 4], max_tokens=UNTIL_ABORTED)
        submit(alice, "last-text", prompt="preparing or queued when the engine stops")
        until(server, lambda: server.llm.request("last") is not None)
        server.request_stop()
        server.run()  # stopped: only the shutdown, which aborts both
        assert not server.requests and not server.llm.has_unfinished()
        while {"last", "last-text"} - set(finals(read(alice, inbox))):  # sent at the shutdown: in alice's socket soon
            assert alice.poll(60_000), "the shutdown's Finals never reached the client"
        assert finals(inbox) == {"text": "abort", "ids": "abort", "text2": "length", "last": "abort",
                                 "last-text": "abort"}
