"""AsyncEngineClient: the asyncio transport over the protocol core (core.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from engine.outputs import Output, RequestOutput
from engine.params import SamplingParams
from engine.prompt import ChatMessage, Prompt, Tools
from engine.service import protocol
from engine.service.addresses import default_address, stats_address
from engine.service.client import core, sockets
from engine.service.protocol import Aborted, Description, Info, Pong, ShuttingDown, Stats, Text, Tokens

T = TypeVar("T")


class AsyncEngineClient:
    """asyncio client (zmq.asyncio), safe to share between tasks of one event loop, e.g. a Textual app.

    A background task reads the socket and files each reply in its waiter's box. As in EngineClient,
    `timeout` is how long the connection may stay silent while someone waits: that task watches it
    for every waiter at once (a stream of 32 requests would otherwise arm 32 timers a step); a call
    given its own timeout (`ping(0.5)`) also has its own timer. `name` labels every request it submits
    for the engine's operators (see EngineClient).
    """

    def __init__(self, address: str | None = None, *, timeout: float = 30.0, auth_token: str | None = None,
                 name: str | None = None) -> None:
        self.address = address or default_address()
        self.timeout = timeout
        self.name = name
        self._token = core.resolve_auth_token(auth_token)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock, self._monitor = sockets.dealer(self._ctx, self.address, self._token)
        self._mail = core.Mailroom(self.address, timeout)
        self._sub: zmq.asyncio.Socket | None = None
        self._feed = core.StatsFeed()
        self._reader: asyncio.Task[None] | None = None
        self._heard = 0.0  # loop time of the last message, or of a new waiter (it restarts the clock)
        self._nonce = itertools.count(1)

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connection_lost(self) -> bool:
        """The connection to the engine broke and nothing has come from it since: a call now would only
        wait for a reconnection (a front end can refuse at once instead)."""
        return self._mail.connection_lost

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        sockets.close(self._sock, self._monitor, self._sub)

    # -- transport --------------------------------------------------------------------------------
    async def _read_forever(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        while True:
            # with waiters, wake when the silence would run out; a waiter that opens meanwhile moves that
            left = self.timeout - (loop.time() - self._heard) if self._mail.boxes else self.timeout
            ready = dict(await poller.poll(int(min(max(left, 0.0), 3600.0) * 1000)))
            if not ready:
                if self._mail.boxes and loop.time() - self._heard >= self.timeout:  # silent too long
                    self._heard = loop.time()
                    self._mail.fail_all("silent")
                continue
            if self._sock in ready:
                self._heard = loop.time()
                self._mail.file(await self._sock.recv())
            if self._monitor in ready:  # the connection broke: every waiter's request is lost
                self._mail.refused |= sockets.is_refusal(await self._monitor.recv_multipart())
                while await self._sock.poll(core.LAST_WORDS_MS):  # what the engine sent before it went
                    self._mail.file(await self._sock.recv())
                self._mail.fail_all("lost")

    def _open(self, key: core.Key) -> core.Box:
        loop = asyncio.get_running_loop()
        self._heard = loop.time()
        if self._reader is None or self._reader.done():
            self._reader = loop.create_task(self._read_forever())
        return self._mail.open(key, asyncio.Event())

    async def _next(self, box: core.Box, timeout: float | None) -> core.Reply:
        """The box's next reply; `timeout` None leaves the watching to the reader (see the class)."""
        assert box.arrived is not None
        while (msg := self._mail.take(box)) is None:  # a fast stream's next message is usually here already
            box.arrived.clear()
            if timeout is None:
                await box.arrived.wait()
                continue
            try:
                async with asyncio.timeout(timeout):
                    await box.arrived.wait()
            except TimeoutError:
                raise self._mail.silent(timeout) from None
        return msg

    async def _send(self, msg: msgspec.Struct, timeout: float | None) -> None:
        """Queue `msg` for the engine, waiting at most `timeout` seconds (see EngineClient._send)."""
        timeout = self.timeout if timeout is None else timeout
        if self._mail.refused:
            raise self._mail.lost()
        try:
            async with asyncio.timeout(timeout):
                await self._sock.send(self._mail.encode(msg))
        except TimeoutError:
            raise self._mail.unsendable(timeout) from None

    async def _call(self, key: core.Key, msg: msgspec.Struct, expect: type[T], timeout: float | None) -> T:
        box = self._open(key)
        try:
            await self._send(msg, timeout)
            return core.reply_as(await self._next(box, timeout), expect)
        finally:
            self._mail.close(key)

    # -- requests ---------------------------------------------------------------------------------
    async def ping(self, timeout: float | None = None) -> Pong:
        nonce = next(self._nonce)
        return await self._call(("pong", nonce), protocol.Ping(nonce=nonce), Pong, timeout)

    async def info(self, timeout: float | None = None) -> Info:
        return await self._call(("info", None), protocol.GetInfo(), Info, timeout)

    async def shutdown(self, timeout: float | None = None) -> int:
        """Ask the engine to stop; returns its pid once it agreed."""
        return (await self._call(("shutdown", None), protocol.Shutdown(), ShuttingDown, timeout)).pid

    async def tokenize(self, prompt: str | list[ChatMessage], *, add_generation_prompt: bool = True,
                       tools: Tools | None = None, template_kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[int]:
        """See EngineClient.tokenize."""
        msg = core.tokenize_message(prompt, add_generation_prompt, tools, template_kwargs)
        return (await self._call(("req", msg.rid), msg, Tokens, timeout)).token_ids

    async def detokenize(self, token_ids: list[int], timeout: float | None = None) -> str:
        """See EngineClient.detokenize."""
        msg = core.detokenize_message(token_ids)
        return (await self._call(("req", msg.rid), msg, Text, timeout)).text

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, rid: str | None = None,
                       tools: Tools | None = None, client: str | None = None,
                       template_kwargs: dict[str, Any] | None = None,
                       **overrides: object) -> AsyncGenerator[Output, None]:
        """Submit (at the first iteration) and stream: Deltas, then a Final. Same arguments as
        EngineClient.submit. Left before its Final, the request is aborted (see core.Stream)."""
        msg = core.submit_message(prompt, params, rid, overrides, tools, client or self.name, template_kwargs)
        key = self._mail.check_new_stream(msg)
        box = self._open(key)
        stream = core.Stream(msg.rid, box)
        try:
            await self._send(msg, None)
            while not stream.done:
                yield stream.accept(await self._next(box, None))
        finally:
            self._mail.close(key)
            if stream.abandoned and not self._sock.closed:  # queued, not awaited: a closing generator may not wait
                self._mail.abandoned(msg.rid)
                self._sock.send(protocol.encode(protocol.Abort(rid=msg.rid)))

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None, *, rid: str | None = None,
                       tools: Tools | None = None, client: str | None = None,
                       template_kwargs: dict[str, Any] | None = None, **overrides: object) -> RequestOutput:
        outputs = self.generate(prompt, params, rid=rid, tools=tools, client=client, template_kwargs=template_kwargs,
                                **overrides)
        return RequestOutput.collect([out async for out in outputs])

    async def abort(self, rid: str, timeout: float | None = None) -> None:
        """Abort any live request; EngineError `unknown_request` if there is none by that id."""
        await self._call(("abort", rid), protocol.Abort(rid=rid), Aborted, timeout)

    async def describe(self, rid: str, text_from: int = 0, timeout: float | None = None) -> Description:
        """See EngineClient.describe."""
        return await self._call(("describe", rid), protocol.Describe(rid=rid, text_from=text_from), Description,
                                timeout)

    # -- stats ------------------------------------------------------------------------------------
    async def stats(self, timeout: float = 5.0) -> Stats:
        """The newest stats snapshot (see EngineClient.stats)."""
        if self._sub is None:
            self._sub = sockets.subscriber(self._ctx, self.address, self._token)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    frames = [await self._sub.recv()]
                    with contextlib.suppress(zmq.Again):
                        while True:
                            frames.append(await self._sub.recv(zmq.NOBLOCK))
                    if (stats := self._feed.take(frames)) is not None:
                        return stats
        except TimeoutError:
            raise core.EngineUnavailable(f"no stats from {stats_address(self.address)} for {timeout:g}s") from None

    async def watch_stats(self, timeout: float = 5.0) -> AsyncIterator[Stats]:
        """Snapshots as they come, newest only."""
        while True:
            yield await self.stats(timeout)
