"""Launcher (find-or-start, readiness handshake, stop), `minichat status/stop/serve`, the async
client, and the address rules. Engines here are real background processes."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from engine import SamplingParams
from engine.outputs import Delta, Final
from engine.params import InvalidParams, invalid_params
from engine.service import protocol
from engine.service.addresses import (
    AddressError,
    check_bindable,
    default_address,
    log_path,
    remove_stale_ipc,
    runtime_dir,
    stats_address,
)
from engine.service.client import AsyncEngineClient, EngineError, EngineUnavailable
from engine.service.launcher import EngineStartError, find, find_or_start, start
from kernels.cpu import load_cpu_kernels
from tests.checkpoints import UNTIL_ABORTED
from tui.cli import app

ENGINE = dict(num_pages=64, max_running_requests=4)


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private XDG_RUNTIME_DIR: the default address and the engine logs live under it."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def free_port_pair() -> int:
    """A tcp port p with p + 1 also free (the engine's stats socket)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def test_launcher_starts_attaches_and_stops(runtime: Path, llama_ckpt: Path) -> None:
    handle = find_or_start(model=str(llama_ckpt), **ENGINE)
    try:
        assert handle.started and handle.address == default_address()
        assert handle.address == f"ipc://{runtime}/minichat/engine.sock"
        assert stat.S_IMODE((runtime / "minichat").stat().st_mode) == 0o700
        attached = find_or_start(model="/not/used/when/attaching")
        assert not attached.started and attached.pid == handle.pid
        attached.stop()  # not ours: a no-op
        with handle.client() as client:
            assert client.info().pid == handle.pid
            assert client.complete("Hello", max_tokens=3).usage.completion_tokens >= 1
            # SIGTERM with a request in flight: its owner still gets a final message.
            stream = client.generate([5, 6, 7], max_tokens=480, ignore_eos=True)
            assert isinstance(next(stream), Delta)
            handle.stop()
            *_, final = stream
            assert isinstance(final, Final) and final.finish_reason == "abort"
    finally:
        handle.stop()
    assert handle.process is not None and handle.process.returncode == 0
    assert find() is None
    assert not (runtime / "minichat" / "engine.sock").exists()
    log = handle.log_path.read_text()
    assert "engine ready" in log and "aborted 1 in-flight request(s)" in log
    assert f"cpu kernels on ({load_cpu_kernels().isa})" in log  # the kernel path, named at start


def test_async_client_streams_aborts_and_reads_stats(runtime: Path, long_ckpt: Path) -> None:
    """The long tiny llama and a pool for a request of UNTIL_ABORTED tokens: the stream left early runs until its
    abort arrives (with 480 tokens of the 512-position llama it finished first once, on CI's loaded machine, and the
    abort it waits for never came)."""
    port = free_port_pair()
    pages = (UNTIL_ABORTED + 64) // 16 + 1
    with start(f"tcp://127.0.0.1:{port}", model=str(long_ckpt), **{**ENGINE, "num_pages": pages}) as handle:
        async def scenario() -> None:
            async with AsyncEngineClient(handle.address) as client:
                info, again = await asyncio.gather(client.info(), client.info())  # two waiters, one key
                assert info == again
                assert info.stats_address == f"tcp://127.0.0.1:{port + 1}" and info.num_pages == pages
                assert (await client.ping()).pid == handle.pid
                done = await client.complete([{"role": "user", "content": "hi"}], max_tokens=3)
                assert done.usage.completion_tokens == len(done.token_ids) >= 1

                # Leaving a stream early aborts its request.
                async for out in client.generate([5, 6, 7], max_tokens=UNTIL_ABORTED, ignore_eos=True, rid="left"):
                    assert isinstance(out, Delta)
                    break
                async for snap in client.watch_stats():
                    if not snap.running and snap.counters.aborted == 1:
                        break

                with pytest.raises(EngineError) as err:
                    async for _ in client.generate("x", max_tokens=-1):
                        pass
                assert err.value.code == "invalid_params"
                with pytest.raises(EngineError, match="unknown_request"):
                    await client.abort("left")

        asyncio.run(asyncio.wait_for(scenario(), 60))
    assert find(handle.address) is None


def test_async_waits_end_when_the_engine_stays_silent(tmp_path: Path) -> None:
    """Nothing answers: a stream fails after the client's timeout (watched by its reader task, for
    every waiter at once), a call given its own shorter timeout after that one."""

    async def scenario() -> None:
        async with AsyncEngineClient(f"ipc://{tmp_path}/nobody.sock", timeout=0.5) as client:
            with pytest.raises(EngineUnavailable, match=r"for 0\.2s"):
                await client.ping(timeout=0.2)
            started = time.monotonic()
            with pytest.raises(EngineUnavailable, match=r"no message from the engine .* for 0\.5s"):
                await asyncio.gather(*(client.complete("hi", rid=f"r{i}") for i in range(3)))
            assert 0.5 <= time.monotonic() - started < 5

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_async_stream_cancelled_as_a_message_arrives_stops(tmp_path: Path) -> None:
    """A task reading a stream that is cancelled in the same loop turn as its next message arrives is
    cancelled (asyncio.wait_for before Python 3.12 returned the message instead, so the reader went on
    and whoever cancelled it, such as a chat tab being closed, waited for the whole reply)."""

    async def scenario() -> None:
        async with AsyncEngineClient(f"ipc://{tmp_path}/nobody.sock") as client:  # sends queue up unread
            got: list[object] = []

            async def read() -> None:
                async for out in client.generate("hi", rid="r1"):
                    got.append(out)

            reader = asyncio.create_task(read())
            while ("req", "r1") not in client._mail.boxes:
                await asyncio.sleep(0)
            await asyncio.sleep(0.01)  # the reader is waiting for its next message
            for i in range(3):  # filed as the reader task files what the engine sends
                item = Delta(rid="r1", text=str(i), token_ids=[i])
                client._mail.file(protocol.encode(protocol.Outputs(items=[item])))
                if i == 0:
                    await asyncio.sleep(0.01)  # one message read
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(reader, 5)
            assert len(got) <= 2  # the backlog may be read on the way, never a hang

    asyncio.run(scenario())


def test_bad_model_path_fails_fast_with_the_log_tail(runtime: Path) -> None:
    log = log_path(default_address())
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("an old run's failure: not this start's cause\n" * 50)  # the log is appended to
    began = time.monotonic()
    with pytest.raises(EngineStartError) as err:
        start(model=str(runtime / "no-such-model"), timeout=60)
    assert "exited with code 1" in str(err.value) and "old run" not in str(err.value)
    assert "cannot load the model" in str(err.value) and "no-such-model" in str(err.value)
    assert time.monotonic() - began < 30
    assert not os.path.exists(runtime / "minichat" / "engine.sock")


def test_port_in_use_fails_with_the_log_tail(runtime: Path, llama_ckpt: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(EngineStartError, match="Address already in use"):
            start(f"tcp://127.0.0.1:{port}", model=str(llama_ckpt), timeout=60)


def test_cli_status_stop_and_serve_refusing_a_taken_address(runtime: Path, llama_ckpt: Path) -> None:
    address = f"ipc://{runtime}/e.sock"
    handle = start(address, model=str(llama_ckpt), **ENGINE)
    runner = CliRunner()
    try:
        serve = subprocess.run([sys.executable, "-m", "tui.cli", "serve", "--address", address,
                                "--model", str(llama_ckpt)], capture_output=True, text=True, timeout=60)
        assert serve.returncode == 1 and f"already answers at {address}" in serve.stderr
        status = runner.invoke(app, ["status", "--address", address])
        assert status.exit_code == 0, status.output
        assert "request slots 0/4 busy" in status.output
        assert "KV pages (16 tokens each, float32 pages of " in status.output and "): 64 free" in status.output
        assert "64 total (1,024 tokens)" in status.output
        # what `auto` resolved to here: the C kernels build on this machine (tests/test_cpu_kernels.py)
        assert "running: request slots 4, attention backend cpu, weights float32, " in status.output
        assert f"gemm float32 prepacked, cpu kernels on ({load_cpu_kernels().isa}), layers one C call a step of up " \
               "to 32 rows (float32 rows kept), oneDNN layer by layer above, overlap off" in status.output
        stop = runner.invoke(app, ["stop", "--address", address])
        assert stop.exit_code == 0 and f"pid {handle.pid}" in stop.output
        assert handle.process.wait(timeout=30) == 0
    finally:
        handle.stop()
    assert runner.invoke(app, ["status", "--address", address, "--timeout", "0.2"]).exit_code == 1
    assert runner.invoke(app, ["stop", "--address", address]).exit_code == 1


def test_serve_without_model_or_demo_model_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from engine.config import EngineConfig
    from engine.service import server

    monkeypatch.setattr(server, "DEMO_MODEL_DIR", tmp_path / "demo_model")
    with pytest.raises(ValueError, match="demo model is not built yet"):
        server.load_llm(EngineConfig())


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://192.168.1.7:5555",
                                     "tcp://example.com:5555"])
def test_non_loopback_needs_allow_remote_and_a_token(address: str) -> None:
    with pytest.raises(AddressError, match="--allow-remote"):
        check_bindable(address)
    with pytest.raises(AddressError, match="--auth-token"):
        check_bindable(address, allow_remote=True)
    check_bindable(address, allow_remote=True, has_token=True)


@pytest.mark.parametrize("address", ["http://127.0.0.1:80", "tcp://127.0.0.1", "tcp://127.0.0.1:65535",
                                     "ipc://", "ipc:///" + "x" * 120, "tcp://::1:5555"])
def test_malformed_addresses_are_refused(address: str) -> None:
    with pytest.raises(AddressError):
        check_bindable(address)


def test_loopback_and_stats_addresses() -> None:
    for address in ("tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555"):
        check_bindable(address)
    assert stats_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5556"
    assert stats_address("ipc:///tmp/e.sock") == "ipc:///tmp/e.sock.stats"


def test_stale_ipc_socket_is_removed_and_a_live_one_is_not(runtime: Path) -> None:
    path = runtime_dir() / "engine.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # bound, never listening, then closed: what a killed engine leaves behind
    remove_stale_ipc(f"ipc://{path}")
    assert not path.exists()
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(path))
        live.listen()
        with pytest.raises(AddressError, match="already listens"):
            remove_stale_ipc(f"ipc://{path}")
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(AddressError, match="not a socket"):
        remove_stale_ipc(f"ipc://{path}")
    assert path.read_text() == "not a socket"


def test_sampling_params_are_the_wire_params() -> None:
    """One SamplingParams in process and on the wire: it round-trips, a Submit whose parameters cannot work
    fails to decode with the constructor's own InvalidParams (tests/test_code_rules.py: no torch for it)."""
    params = SamplingParams(max_tokens=4, temperature=0.5, stop="\n", seed=7)
    assert params.stop == ["\n"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    with pytest.raises(InvalidParams) as direct:
        SamplingParams(top_p=0.0)
    bad = msgspec.msgpack.encode({"type": "submit", "rid": "r", "prompt": "hi", "params": {"top_p": 0.0}})
    with pytest.raises(msgspec.ValidationError) as wire:
        protocol.decode_client(bad)
    cause = invalid_params(wire.value)
    assert cause is not None and str(cause) == str(direct.value)
    typo = msgspec.msgpack.encode({"type": "submit", "rid": "r", "prompt": "hi", "params": {"top_pp": 0.5}})
    with pytest.raises(msgspec.ValidationError) as malformed:
        protocol.decode_client(typo)
    assert invalid_params(malformed.value) is None  # a malformed message, not parameters that cannot work
