"""EngineClient: the blocking transport over the protocol core (core.py), and `probe`."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import msgspec
import zmq

from engine.outputs import Output, RequestOutput
from engine.params import SamplingParams
from engine.prompt import ChatMessage, Prompt, Tools
from engine.service import protocol
from engine.service.addresses import default_address, ipc_listening, split, stats_address
from engine.service.client import core, sockets
from engine.service.protocol import Aborted, Description, Info, Pong, ShuttingDown, Stats, Text, Tokens

T = TypeVar("T")


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
        except core.EngineRefused:
            raise
        except core.EngineUnavailable:
            return None


class EngineClient:
    """Blocking client. Not thread-safe (ZeroMQ sockets are not); use one per thread.

    Replies for requests other than the one being read are filed for later, so several `generate`
    iterators may be interleaved. `timeout` is how long to wait for any message before deciding
    the engine is gone (the engine sends a heartbeat every second while a request is live); a
    closed connection is noticed at once. `name` labels every request it submits ("bench", "nightly
    eval"), so an operator watching the engine's stats sees whose requests they are; without one the
    engine numbers the connection ("client 3"). A submit's own `client=` overrides it.
    """

    def __init__(self, address: str | None = None, *, timeout: float = 30.0, auth_token: str | None = None,
                 name: str | None = None) -> None:
        self.address = address or default_address()
        self.timeout = timeout
        self.name = name
        self._token = core.resolve_auth_token(auth_token)
        self._ctx: zmq.Context[zmq.Socket] = zmq.Context.instance()
        self._sock, self._monitor = sockets.dealer(self._ctx, self.address, self._token)
        self._mail = core.Mailroom(self.address, timeout)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sub: zmq.Socket | None = None
        self._feed = core.StatsFeed()
        self._nonce = itertools.count(1)

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        sockets.close(self._sock, self._monitor, self._sub)

    # -- transport --------------------------------------------------------------------------------
    def _send(self, msg: msgspec.Struct, timeout: float | None = None) -> None:
        """Queue `msg` for the engine. Without a connection (a refused token ends it for good) a DEALER
        would block forever, so this waits at most `timeout` seconds; a refusal already seen fails at once."""
        timeout = self.timeout if timeout is None else timeout
        if self._mail.refused or not self._sock.poll(int(timeout * 1000), zmq.POLLOUT):
            self._read_monitor()
            raise self._mail.unsendable(timeout)
        self._sock.send(self._mail.encode(msg), zmq.NOBLOCK)

    def _read_monitor(self) -> None:
        """Take the connection's events: after a disconnect or a refusal, file what the engine sent
        before it went, then fail every open box. A box opened after the event is not failed by it."""
        broke = False
        while self._monitor.poll(0):
            self._mail.refused |= sockets.is_refusal(self._monitor.recv_multipart())
            broke = True
        if broke and self._mail.boxes:
            while self._sock.poll(core.LAST_WORDS_MS):
                self._mail.file(self._sock.recv())
            while self._monitor.poll(0):  # a refusal's event may trail the disconnect's
                self._mail.refused |= sockets.is_refusal(self._monitor.recv_multipart())
            self._mail.fail_all("lost")

    def _open(self, key: core.Key) -> core.Box:
        self._read_monitor()  # an event from before this waiter opened is not its failure
        return self._mail.open(key)

    def _wait(self, box: core.Box, timeout: float | None = None) -> core.Reply:
        """The box's next reply, reading (and filing) others meanwhile."""
        timeout = self.timeout if timeout is None else timeout
        while (msg := self._mail.take(box)) is None:
            ready = dict(self._poller.poll(int(timeout * 1000)))
            if not ready:
                raise self._mail.silent(timeout)
            if self._sock in ready:
                self._mail.file(self._sock.recv())
            if self._monitor in ready:
                self._read_monitor()
        return msg

    def _call(self, key: core.Key, msg: msgspec.Struct, expect: type[T], timeout: float | None) -> T:
        box = self._open(key)
        try:
            self._send(msg, timeout)
            return core.reply_as(self._wait(box, timeout), expect)
        finally:
            self._mail.close(key)

    # -- requests ---------------------------------------------------------------------------------
    def ping(self, timeout: float | None = None) -> Pong:
        """Round trip to the engine; raises EngineUnavailable if it does not answer in time."""
        nonce = next(self._nonce)
        return self._call(("pong", nonce), protocol.Ping(nonce=nonce), Pong, timeout)

    def info(self, timeout: float | None = None) -> Info:
        """Model, configuration, limits and version of the engine."""
        return self._call(("info", None), protocol.GetInfo(), Info, timeout)

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, rid: str | None = None,
               tools: Tools | None = None, client: str | None = None, template_kwargs: dict[str, Any] | None = None,
               **overrides: object) -> str:
        """Queue a request and return its id without reading output; read it with `stream(rid)`.

        `prompt` is text, token ids or chat messages (with `tools` and more `template_kwargs` for the chat
        template, e.g. {"enable_thinking": False}); sampling options come from `params` and/or keywords
        (max_tokens, temperature, top_k, top_p, ...); `client` labels this request (default: the client's
        `name`).
        """
        msg = core.submit_message(prompt, params, rid, overrides, tools, client or self.name, template_kwargs)
        key = self._mail.check_new_stream(msg)
        self._open(key)
        try:
            self._send(msg)
        except core.EngineUnavailable:
            self._mail.close(key)
            raise
        return msg.rid

    def stream(self, rid: str) -> Iterator[Output]:
        """Yield a submitted request's Deltas and then its Final; raises EngineError if refused.
        Left before its Final, the request is aborted (see core.Stream)."""
        key = ("req", rid)
        box = self._mail.boxes.get(key) or self._open(key)
        stream = core.Stream(rid, box)
        try:
            while not stream.done:
                yield stream.accept(self._wait(box))
        finally:
            self._mail.close(key)
            if stream.abandoned and not self._sock.closed:  # queued without waiting; no connection: nothing runs
                with contextlib.suppress(zmq.Again):
                    self._sock.send(protocol.encode(protocol.Abort(rid=rid)), zmq.NOBLOCK)
                    self._mail.abandoned(rid)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, rid: str | None = None,
                 tools: Tools | None = None, client: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 **overrides: object) -> Iterator[Output]:
        """Submit (at once) and stream: Deltas as tokens are produced, then a Final with usage and timings."""
        return self.stream(self.submit(prompt, params, rid=rid, tools=tools, client=client,
                                       template_kwargs=template_kwargs, **overrides))

    def complete(self, prompt: Prompt, params: SamplingParams | None = None, *, rid: str | None = None,
                 tools: Tools | None = None, client: str | None = None, template_kwargs: dict[str, Any] | None = None,
                 **overrides: object) -> RequestOutput:
        """Submit and wait for the whole output."""
        return RequestOutput.collect(list(self.generate(prompt, params, rid=rid, tools=tools, client=client,
                                                        template_kwargs=template_kwargs,
                                                        **overrides)))

    def abort(self, rid: str, timeout: float | None = None) -> None:
        """Abort any live request (not only this client's); EngineError `unknown_request` if none."""
        self._call(("abort", rid), protocol.Abort(rid=rid), Aborted, timeout)

    def describe(self, rid: str, text_from: int = 0, timeout: float | None = None) -> Description:
        """Everything about one live request, any client's (who sent it, prompt head, parameters, pages,
        timings, its output from character `text_from` on); state "gone" once it is not live."""
        return self._call(("describe", rid), protocol.Describe(rid=rid, text_from=text_from), Description, timeout)

    def shutdown(self, timeout: float | None = None) -> int:
        """Ask the engine to stop (in-flight requests end with "abort"); returns its pid once it agreed."""
        return self._call(("shutdown", None), protocol.Shutdown(), ShuttingDown, timeout).pid

    def tokenize(self, prompt: str | list[ChatMessage], *, add_generation_prompt: bool = True,
                 tools: Tools | None = None, template_kwargs: dict[str, Any] | None = None,
                 timeout: float | None = None) -> list[int]:
        """The token ids a `generate` of this text or these chat messages would start from (chat:
        through the model's template, with `tools` and `template_kwargs` as a `generate` gives them, ending
        with the assistant's turn unless `add_generation_prompt` is off); EngineError `invalid_request` for
        what the engine cannot tokenize."""
        msg = core.tokenize_message(prompt, add_generation_prompt, tools, template_kwargs)
        return self._call(("req", msg.rid), msg, Tokens, timeout).token_ids

    def detokenize(self, token_ids: list[int], timeout: float | None = None) -> str:
        """The text of these token ids, special tokens included; EngineError `invalid_request` for ids
        outside the vocabulary or none at all."""
        msg = core.detokenize_message(token_ids)
        return self._call(("req", msg.rid), msg, Text, timeout).text

    # -- stats ------------------------------------------------------------------------------------
    def stats(self, timeout: float = 5.0) -> Stats:
        """The newest stats snapshot, waiting for one if none is queued (the engine publishes about ten a
        second); its page map paints every KV page (core.StatsFeed)."""
        if self._sub is None:
            self._sub = sockets.subscriber(self._ctx, self.address, self._token)
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0 and self._sub.poll(int(left * 1000)):
            frames = []
            with contextlib.suppress(zmq.Again):
                while True:
                    frames.append(self._sub.recv(zmq.NOBLOCK))
            if (stats := self._feed.take(frames)) is not None:
                return stats
        raise core.EngineUnavailable(f"no stats from {stats_address(self.address)} for {timeout:g}s")

    def watch_stats(self, timeout: float = 5.0) -> Iterator[Stats]:
        """Snapshots as they come, newest only (a slow reader skips stale ones)."""
        while True:
            yield self.stats(timeout)

    def wait_stats(self, predicate: Callable[[Stats], bool], timeout: float = 10.0) -> Stats:
        """The first snapshot for which `predicate` holds; TimeoutError with the last one otherwise (EngineUnavailable
        when none came at all)."""
        end = time.monotonic() + timeout
        last = None
        while (left := end - time.monotonic()) > 0:
            try:
                last = self.stats(left)
            except core.EngineUnavailable:
                if last is None:
                    raise
                break  # snapshots came, but not the next one within what was left of the wait
            if predicate(last):
                return last
        raise TimeoutError(f"stats condition not met within {timeout:g}s; last snapshot: {last}")
