"""Clients for the engine process: `EngineClient` (blocking) and `AsyncEngineClient` (asyncio).

Both speak the protocol in docs/protocol.md over one DEALER socket, so many requests can stream at
once over one connection, and read live stats from the engine's PUB socket. Neither imports torch,
so a TUI or a load generator starts fast.

    with EngineClient() as client:                     # default per-user ipc address
        for out in client.generate("Once upon a time", max_tokens=32):
            print(out.text, end="", flush=True)        # out is a Delta, and lastly a Final
        print(client.stats().counters)

    async with AsyncEngineClient(address) as client:
        async for out in client.generate([{"role": "user", "content": "hi"}], temperature=0.7):
            ...

Closing a `generate` iterator before its Final (break, task cancellation) aborts the request, so
an abandoned stream never keeps generating. A lost connection (the engine stopped or died) raises
`EngineUnavailable` in every waiting call at once, not at the end of its timeout. An engine started
with `--auth-token` needs the same token: pass `auth_token=` or set MINICHAT_AUTH_TOKEN.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine.prompt import Prompt
from engine.service import protocol
from engine.service.addresses import default_address, ipc_listening, split, stats_address
from engine.service.protocol import (
    Aborted,
    Delta,
    Error,
    Final,
    Info,
    Params,
    Pong,
    ShuttingDown,
    Stats,
    Timings,
    Usage,
)

Output = Delta | Final
_Key = tuple[str, object]
AUTH_USER = "minichat"  # the ZeroMQ PLAIN user name; the auth token is the password
AUTH_ENV = "MINICHAT_AUTH_TOKEN"
LAST_WORDS_MS = 100  # after a disconnect, how long replies the engine sent before it went may still take
_REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_GONE = "the connection to the engine was lost"  # queued to async waiters when the engine disconnects
_SILENT = "the engine sent nothing for the client's timeout"  # queued to async waiters when it stays silent


class EngineError(Exception):
    """The engine refused a message; `code` is one of protocol.Error's codes."""

    def __init__(self, code: str, message: str, rid: str | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.rid = code, message, rid


class EngineUnavailable(ConnectionError):
    """No engine answered in time (not started, stopped, or wedged)."""


class EngineRefused(EngineUnavailable):
    """An engine answers at the address but refused this client's auth token."""


@dataclass
class Completion:
    """A whole finished request, as `complete()` returns it."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    timings: Timings


def submit_message(prompt: Prompt, params: Params | None, rid: str | None,
                   overrides: dict[str, object]) -> protocol.Submit:
    """Build a Submit from the same prompt forms `LLM.add_request` takes (text, token ids, chat messages)."""
    params = msgspec.structs.replace(params or Params(), **overrides)
    rid = rid if rid is not None else uuid.uuid4().hex
    if isinstance(prompt, str):
        return protocol.Submit(rid=rid, prompt=prompt, params=params)
    if prompt and all(isinstance(m, dict) for m in prompt):
        messages = [protocol.ChatMessage(role=m["role"], content=m["content"]) for m in prompt]  # type: ignore[index]
        return protocol.Submit(rid=rid, messages=messages, params=params)
    return protocol.Submit(rid=rid, token_ids=list(prompt), params=params)  # type: ignore[arg-type]


def _route(msg: protocol.EngineMessage | Delta | Final) -> _Key | None:
    """Which waiter a reply belongs to: a request's stream, an abort, a ping, an info (None: nobody)."""
    if isinstance(msg, (Delta, Final)):
        return ("req", msg.rid)
    if isinstance(msg, Aborted):
        return ("abort", msg.rid)
    if isinstance(msg, Error):
        return ("abort" if msg.code == "unknown_request" else "req", msg.rid) if msg.rid is not None else None
    if isinstance(msg, Pong):
        return ("pong", msg.nonce)
    if isinstance(msg, Info):
        return ("info", None)
    if isinstance(msg, ShuttingDown):
        return ("shutdown", None)
    return None  # Heartbeat: its arrival alone is the point


def _decode(data: bytes) -> list[protocol.EngineMessage | Delta | Final]:
    """The replies in one message: a step's `Outputs` unpacked into its Deltas and Finals, any other
    reply alone, nothing for bytes that are not a reply (skipped: only the engine should be talking)."""
    try:
        msg = protocol.decode_engine(data)
    except protocol.DecodeError:
        return []
    return list(msg.items) if isinstance(msg, protocol.Outputs) else [msg]


def _raise_if_error(msg: protocol.EngineMessage) -> None:
    if isinstance(msg, Error):
        raise EngineError(msg.code, msg.message, msg.rid)


def resolve_auth_token(given: str | None = None) -> str | None:
    """The token to present: the one given, else $MINICHAT_AUTH_TOKEN, else none."""
    return given if given is not None else os.environ.get(AUTH_ENV) or None


def _secure(sock: zmq.Socket, token: str | None) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT
    if token is not None:
        sock.setsockopt(zmq.PLAIN_USERNAME, AUTH_USER.encode())
        sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
    return sock


def _dealer(ctx: zmq.Context, address: str, token: str | None = None) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to the engine, and the monitor of its connection (see `_watch`)."""
    sock = _secure(ctx.socket(zmq.DEALER), token)
    sock.setsockopt(zmq.RCVHWM, 0)  # never make the engine's send fail because we read slowly
    sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
    monitor = _watch(sock)  # before connecting: a refusal can come back before the next line would run
    sock.connect(address)
    return sock, monitor


def _subscriber(ctx: zmq.Context, address: str, token: str | None = None) -> zmq.Socket:
    sock = _secure(ctx.socket(zmq.SUB), token)
    sock.setsockopt(zmq.CONFLATE, 1)  # only the newest snapshot matters; each one is complete
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(stats_address(address))
    return sock


def _watch(sock: zmq.Socket) -> zmq.Socket:
    """A monitor of `sock`'s connection: disconnects, and the engine refusing this client's handshake
    (a wrong token fails PLAIN's; no token, where the engine wants one, fails the protocol's)."""
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _REFUSALS)


def _is_refusal(frames: list[bytes]) -> bool:
    return bool(parse_monitor_message(frames)["event"] & _REFUSALS)


def _lost(address: str, refused: bool) -> EngineUnavailable:
    if refused:
        return EngineRefused(f"the engine at {address} refused this client: wrong or missing auth token (give "
                             f"the engine's --auth-token, or set {AUTH_ENV})")
    return EngineUnavailable(f"the engine at {address} closed the connection (it stopped or died, dropped "
                             f"this client, or wants an auth token); requests in flight are lost")


def _silent(address: str, timeout: float) -> EngineUnavailable:
    return EngineUnavailable(f"no message from the engine at {address} for {timeout:g}s")


def _unsendable(address: str, timeout: float, refused: bool) -> EngineUnavailable:
    """Why a send found no connection for `timeout` seconds: the engine refused this client, or none."""
    if refused:
        return _lost(address, True)
    return EngineUnavailable(f"could not hand a message to the engine at {address} for {timeout:g}s "
                             f"(no connection to it)")


def probe(address: str | None = None, timeout: float = 0.5, auth_token: str | None = None) -> Pong | None:
    """The engine's Pong if one answers at `address` within `timeout` seconds, else None.

    An engine that refuses the token is there all the same: EngineRefused, not None."""
    address = address or default_address()
    scheme, path = split(address)
    if scheme == "ipc" and not ipc_listening(path):
        return None  # nothing listens: answer at once instead of waiting for a connect that never happens
    with EngineClient(address, timeout=timeout, auth_token=auth_token) as client:
        try:
            return client.ping(timeout)
        except EngineRefused:
            raise
        except EngineUnavailable:
            return None


class EngineClient:
    """Blocking client. Not thread-safe (ZeroMQ sockets are not); use one per thread.

    Replies for requests other than the one being read are buffered, so several `generate`
    iterators may be interleaved. `timeout` is how long to wait for any message before deciding
    the engine is gone (the engine sends a heartbeat every second while a request is live); a
    closed connection is noticed at once.
    """

    def __init__(self, address: str | None = None, *, timeout: float = 30.0, auth_token: str | None = None) -> None:
        self.address = address or default_address()
        self.timeout = timeout
        self._token = resolve_auth_token(auth_token)
        self._ctx = zmq.Context.instance()
        self._sock, self._monitor = _dealer(self._ctx, self.address, self._token)
        self._refused = False
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sub: zmq.Socket | None = None
        self._boxes: dict[_Key, deque[protocol.EngineMessage]] = {}
        self._since: dict[_Key, int] = {}  # disconnects counted when each waiter registered
        self._disconnects = 0
        self._nonce = itertools.count(1)

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._sub is not None:
            self._sub.close(linger=0)

    # -- plumbing ---------------------------------------------------------------------------------
    def _send(self, msg: msgspec.Struct, timeout: float | None = None) -> None:
        """Queue `msg` for the engine. Without a connection (a refused token ends it for good) a DEALER
        would block forever, so this waits at most `timeout` seconds; a refusal already seen (callers
        `_register` first, which reads the monitor) fails at once."""
        timeout = self.timeout if timeout is None else timeout
        if self._refused or not self._sock.poll(int(timeout * 1000), zmq.POLLOUT):
            self._count_disconnects()
            raise _unsendable(self.address, timeout, self._refused)
        self._sock.send(protocol.encode(msg), zmq.NOBLOCK)

    def _count_disconnects(self) -> None:
        while self._monitor.poll(0):
            self._refused |= _is_refusal(self._monitor.recv_multipart())
            self._disconnects += 1

    def _register(self, key: _Key) -> None:
        """Start filing replies for `key`; a disconnect from now on fails its waits."""
        self._count_disconnects()
        self._boxes[key] = deque()
        self._since[key] = self._disconnects

    def _unregister(self, key: _Key) -> None:
        self._boxes.pop(key, None)
        self._since.pop(key, None)

    def _wait(self, key: _Key, timeout: float | None = None) -> protocol.EngineMessage:
        """The next message for `key`, reading (and filing) others meanwhile."""
        if key not in self._boxes:
            self._register(key)
        box = self._boxes[key]
        timeout = self.timeout if timeout is None else timeout
        while not box:
            self._count_disconnects()
            if self._disconnects > self._since[key]:
                while not box and self._sock.poll(LAST_WORDS_MS):  # what the engine sent before it went
                    self._file(self._sock.recv())
                if not box:
                    self._count_disconnects()  # a refusal's event may trail the disconnect's
                    raise _lost(self.address, self._refused)
                break
            ready = dict(self._poller.poll(int(timeout * 1000)))
            if not ready:
                raise _silent(self.address, timeout)
            if self._sock in ready:
                self._file(self._sock.recv())
        return box.popleft()

    def _file(self, data: bytes) -> None:
        for msg in _decode(data):
            dest = _route(msg)
            if dest in self._boxes:
                self._boxes[dest].append(msg)  # type: ignore[arg-type]

    def _call(self, key: _Key, msg: msgspec.Struct, timeout: float | None) -> protocol.EngineMessage:
        self._register(key)
        try:
            self._send(msg, timeout)
            return self._wait(key, timeout)
        finally:
            self._unregister(key)

    # -- requests ---------------------------------------------------------------------------------
    def ping(self, timeout: float | None = None) -> Pong:
        """Round trip to the engine; raises EngineUnavailable if it does not answer in time."""
        nonce = next(self._nonce)
        return self._call(("pong", nonce), protocol.Ping(nonce=nonce), timeout)  # type: ignore[return-value]

    def info(self, timeout: float | None = None) -> Info:
        """Model, configuration, limits and version of the engine."""
        return self._call(("info", None), protocol.GetInfo(), timeout)  # type: ignore[return-value]

    def submit(self, prompt: Prompt, params: Params | None = None, *, rid: str | None = None,
               **overrides: object) -> str:
        """Queue a request and return its id without reading output; read it with `stream(rid)`.

        `prompt` is text, token ids or chat messages; sampling options come from `params` and/or
        keywords (max_tokens, temperature, top_k, top_p, ignore_eos, stop, seed).
        """
        msg = submit_message(prompt, params, rid, overrides)
        if ("req", msg.rid) in self._boxes:  # refused here: the engine's refusal would end the live stream
            raise EngineError("duplicate_request", f"request id {msg.rid!r} is live on this client", msg.rid)
        self._register(("req", msg.rid))
        self._send(msg)
        return msg.rid

    def stream(self, rid: str) -> Iterator[Output]:
        """Yield a submitted request's Deltas and then its Final; raises EngineError if refused."""
        key = ("req", rid)
        finished = False
        try:
            while not finished:
                msg = self._wait(key)
                _raise_if_error(msg)
                finished = isinstance(msg, Final)
                yield msg  # type: ignore[misc]
        except EngineError:
            finished = True
            raise
        finally:
            self._unregister(key)
            if not finished and not self._sock.closed:
                with contextlib.suppress(EngineUnavailable):  # no connection: nothing left to stop
                    self._send(protocol.Abort(rid=rid), LAST_WORDS_MS / 1000)

    def generate(self, prompt: Prompt, params: Params | None = None, *, rid: str | None = None,
                 **overrides: object) -> Iterator[Output]:
        """Submit and stream: Deltas as tokens are produced, then a Final with usage and timings."""
        return self.stream(self.submit(prompt, params, rid=rid, **overrides))

    def complete(self, prompt: Prompt, params: Params | None = None, *, rid: str | None = None,
                 **overrides: object) -> Completion:
        """Submit and wait for the whole output."""
        return _collect(list(self.generate(prompt, params, rid=rid, **overrides)))

    def abort(self, rid: str, timeout: float | None = None) -> None:
        """Abort any live request (not only this client's); EngineError `unknown_request` if none."""
        _raise_if_error(self._call(("abort", rid), protocol.Abort(rid=rid), timeout))

    def shutdown(self, timeout: float | None = None) -> int:
        """Ask the engine to stop (in-flight requests end with "abort"); returns its pid once it agreed."""
        return self._call(("shutdown", None), protocol.Shutdown(), timeout).pid  # type: ignore[union-attr]

    # -- stats ------------------------------------------------------------------------------------
    def stats(self, timeout: float = 5.0) -> Stats:
        """The next stats snapshot (the engine publishes about ten a second)."""
        if self._sub is None:
            self._sub = _subscriber(self._ctx, self.address, self._token)
        if not self._sub.poll(int(timeout * 1000)):
            raise EngineUnavailable(f"no stats from {stats_address(self.address)} for {timeout:g}s")
        return protocol.decode_stats(self._sub.recv())

    def watch_stats(self, timeout: float = 5.0) -> Iterator[Stats]:
        """Snapshots as they come, newest only (a slow reader skips stale ones)."""
        while True:
            yield self.stats(timeout)

    def wait_stats(self, predicate: Callable[[Stats], bool], timeout: float = 10.0) -> Stats:
        """The first snapshot for which `predicate` holds; TimeoutError with the last one otherwise."""
        end = time.monotonic() + timeout
        last = None
        while (left := end - time.monotonic()) > 0:
            last = self.stats(left)
            if predicate(last):
                return last
        raise TimeoutError(f"stats condition not met within {timeout:g}s; last snapshot: {last}")


class AsyncEngineClient:
    """asyncio client (zmq.asyncio), safe to share between tasks of one event loop, e.g. a Textual app.

    A background task reads the socket and hands each reply to the task waiting for it. As in
    EngineClient, `timeout` is how long the connection may stay silent while someone waits: that task
    watches it for every waiter at once (a stream of 32 requests would otherwise arm 32 timers a
    step); a call given its own timeout (`ping(0.5)`) also has its own timer.
    """

    def __init__(self, address: str | None = None, *, timeout: float = 30.0, auth_token: str | None = None) -> None:
        self.address = address or default_address()
        self.timeout = timeout
        self._token = resolve_auth_token(auth_token)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock, self._monitor = _dealer(self._ctx, self.address, self._token)
        self._refused = False
        self._sub: zmq.asyncio.Socket | None = None
        self._queues: dict[_Key, asyncio.Queue[protocol.EngineMessage]] = {}
        self._waiters: dict[_Key, int] = {}
        self._reader: asyncio.Task[None] | None = None
        self._heard = 0.0  # loop time of the last message, or of a new waiter (it restarts the clock)
        self._nonce = itertools.count(1)

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if not self._sock.closed:
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._sub is not None:
            self._sub.close(linger=0)

    # -- plumbing ---------------------------------------------------------------------------------
    async def _read_forever(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        while True:
            # with waiters, wake when the silence would run out; a waiter that opens meanwhile moves that
            left = self.timeout - (loop.time() - self._heard) if self._queues else self.timeout
            ready = dict(await poller.poll(int(min(max(left, 0.0), 3600.0) * 1000)))
            if not ready:
                if self._queues and loop.time() - self._heard >= self.timeout:  # silent too long: fail every waiter
                    self._heard = loop.time()
                    for queue in self._queues.values():
                        queue.put_nowait(_SILENT)  # type: ignore[arg-type]
                continue
            if self._sock in ready:
                self._heard = loop.time()
                self._file(await self._sock.recv())
            if self._monitor in ready:  # the connection broke: every waiter's request is lost
                self._refused |= _is_refusal(await self._monitor.recv_multipart())
                while await self._sock.poll(LAST_WORDS_MS):  # what the engine sent before it went
                    self._file(await self._sock.recv())
                for queue in self._queues.values():
                    queue.put_nowait(_GONE)  # type: ignore[arg-type]

    def _file(self, data: bytes) -> None:
        for msg in _decode(data):
            queue = self._queues.get(_route(msg))  # type: ignore[arg-type]
            if queue is not None:
                queue.put_nowait(msg)

    def _open(self, key: _Key) -> asyncio.Queue[protocol.EngineMessage]:
        """The queue replies for `key` land in. Tasks waiting on the same key (two `info()` calls) share
        it: each sent its own request, so each gets one reply."""
        loop = asyncio.get_running_loop()
        self._heard = loop.time()
        if self._reader is None or self._reader.done():
            self._reader = loop.create_task(self._read_forever())
        self._waiters[key] = self._waiters.get(key, 0) + 1
        return self._queues.setdefault(key, asyncio.Queue())

    def _close(self, key: _Key) -> None:
        self._waiters[key] -= 1
        if not self._waiters[key]:
            del self._waiters[key], self._queues[key]

    async def _get(self, queue: asyncio.Queue[protocol.EngineMessage], timeout: float | None) -> protocol.EngineMessage:
        """The next message in `queue`; `timeout` None leaves the watching to the reader (see the class)."""
        if not queue.empty():  # a fast stream's next message is usually here already
            msg = queue.get_nowait()
        elif timeout is None:
            msg = await queue.get()
        else:
            try:
                async with asyncio.timeout(timeout):
                    msg = await queue.get()
            except TimeoutError:
                raise _silent(self.address, timeout) from None
        if msg is _GONE:
            raise _lost(self.address, self._refused)
        if msg is _SILENT:
            raise _silent(self.address, self.timeout)
        return msg

    async def _send(self, msg: msgspec.Struct, timeout: float | None) -> None:
        """Queue `msg` for the engine, waiting at most `timeout` seconds (see EngineClient._send)."""
        timeout = self.timeout if timeout is None else timeout
        if self._refused:
            raise _lost(self.address, True)
        try:
            async with asyncio.timeout(timeout):
                await self._sock.send(protocol.encode(msg))
        except TimeoutError:
            raise _unsendable(self.address, timeout, self._refused) from None

    async def _call(self, key: _Key, msg: msgspec.Struct, timeout: float | None) -> protocol.EngineMessage:
        queue = self._open(key)
        try:
            await self._send(msg, timeout)
            return await self._get(queue, timeout)
        finally:
            self._close(key)

    # -- requests ---------------------------------------------------------------------------------
    async def ping(self, timeout: float | None = None) -> Pong:
        nonce = next(self._nonce)
        return await self._call(("pong", nonce), protocol.Ping(nonce=nonce), timeout)  # type: ignore[return-value]

    async def info(self, timeout: float | None = None) -> Info:
        return await self._call(("info", None), protocol.GetInfo(), timeout)  # type: ignore[return-value]

    async def shutdown(self, timeout: float | None = None) -> int:
        """Ask the engine to stop; returns its pid once it agreed."""
        return (await self._call(("shutdown", None), protocol.Shutdown(), timeout)).pid  # type: ignore[union-attr]

    async def generate(self, prompt: Prompt, params: Params | None = None, *, rid: str | None = None,
                       **overrides: object) -> AsyncIterator[Output]:
        """Submit and stream: Deltas, then a Final. Same arguments as EngineClient.submit."""
        msg = submit_message(prompt, params, rid, overrides)
        key = ("req", msg.rid)
        if key in self._queues:  # refused here: the engine's refusal would end the live stream
            raise EngineError("duplicate_request", f"request id {msg.rid!r} is live on this client", msg.rid)
        queue = self._open(key)
        finished = False
        try:
            await self._send(msg, None)
            while not finished:
                out = await self._get(queue, None)
                _raise_if_error(out)
                finished = isinstance(out, Final)
                yield out  # type: ignore[misc]
        except EngineError:
            finished = True
            raise
        finally:
            self._close(key)
            if not finished and not self._sock.closed:  # abandoned or cancelled: stop the generation
                self._sock.send(protocol.encode(protocol.Abort(rid=msg.rid)))

    async def complete(self, prompt: Prompt, params: Params | None = None, *, rid: str | None = None,
                       **overrides: object) -> Completion:
        return _collect([out async for out in self.generate(prompt, params, rid=rid, **overrides)])

    async def abort(self, rid: str, timeout: float | None = None) -> None:
        """Abort any live request; EngineError `unknown_request` if there is none by that id."""
        _raise_if_error(await self._call(("abort", rid), protocol.Abort(rid=rid), timeout))

    # -- stats ------------------------------------------------------------------------------------
    async def stats(self, timeout: float = 5.0) -> Stats:
        """The next stats snapshot."""
        if self._sub is None:
            self._sub = _subscriber(self._ctx, self.address, self._token)
        try:
            async with asyncio.timeout(timeout):
                data = await self._sub.recv()
        except TimeoutError:
            raise EngineUnavailable(f"no stats from {stats_address(self.address)} for {timeout:g}s") from None
        return protocol.decode_stats(data)

    async def watch_stats(self, timeout: float = 5.0) -> AsyncIterator[Stats]:
        """Snapshots as they come, newest only."""
        while True:
            yield await self.stats(timeout)


def _collect(outputs: list[Output]) -> Completion:
    final = outputs[-1]
    assert isinstance(final, Final)
    return Completion(rid=final.rid, text="".join(o.text for o in outputs),
                      token_ids=[t for o in outputs for t in o.token_ids], finish_reason=final.finish_reason,
                      usage=final.usage, timings=final.timings)

