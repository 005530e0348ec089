"""The protocol core both clients share: what to send, which waiter a reply belongs to, when a stream
is over, and how a lost or silent connection fails every waiter at once.

It does no I/O. A transport (blocking.py, aio.py) owns the sockets: it hands every frame it reads to
`Mailroom.file`, tells it when the connection broke (`fail_all`), and waits on a `Box` until `take`
gives it a reply or raises; and every stats frame to a `StatsFeed`.
"""

from __future__ import annotations

import asyncio
import collections
import os
import uuid
from collections import deque
from typing import Any, Literal, TypeVar

import msgspec

from engine.outputs import Delta, Final, Output
from engine.pages import PageRun
from engine.params import SamplingParams
from engine.prompt import ChatMessage, Prompt, Tools
from engine.service import protocol
from engine.service.protocol import Aborted, Description, Error, Info, Pong, ShuttingDown, Stats, Text, Tokens

# ("req", rid): a request's stream or a (de)tokenize call's reply; ("abort", rid), ("describe", rid), ("pong", nonce),
# ("info", None), ("shutdown", None)
Key = tuple[str, object]
Reply = protocol.EngineMessage | Delta | Final
T = TypeVar("T")
AUTH_USER = "minichat"  # the ZeroMQ PLAIN user name; the auth token is the password
AUTH_ENV = "MINICHAT_AUTH_TOKEN"
LAST_WORDS_MS = 100  # after a disconnect, how long replies the engine sent before it went may still take
Failure = Literal["lost", "silent"]


class EngineError(Exception):
    """The engine refused a message; `code` is one of protocol.Error's codes."""

    def __init__(self, code: str, message: str, rid: str | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.rid = code, message, rid


class EngineUnavailable(ConnectionError):
    """No engine answered in time (not started, stopped, or wedged)."""


class EngineRefused(EngineUnavailable):
    """An engine answers at the address but refused this client's auth token."""


def resolve_auth_token(given: str | None = None) -> str | None:
    """The token to present: the one given, else $MINICHAT_AUTH_TOKEN, else none."""
    return given if given is not None else os.environ.get(AUTH_ENV) or None


def submit_message(prompt: Prompt, params: SamplingParams | None, rid: str | None,
                   overrides: dict[str, object], tools: Tools | None = None,
                   client: str | None = None, template_kwargs: dict[str, Any] | None = None) -> protocol.Submit:
    """A Submit for the prompt forms `LLM.add_request` takes (text, token ids, chat messages; `tools`
    and `template_kwargs` go with chat messages), labelled with `client` (who sends it, for the engine's
    operators).

    Parameters the engine would refuse are refused here, with the engine's code and sentence."""
    rid = rid if rid is not None else uuid.uuid4().hex
    try:
        params = msgspec.structs.replace(params or SamplingParams(), **overrides)
    except ValueError as e:  # SamplingParams validates on replace, as the engine does on decode
        raise EngineError("invalid_params", str(e), rid) from None
    if isinstance(prompt, str):
        return protocol.Submit(rid=rid, prompt=prompt, params=params, client=client)
    messages = [m for m in prompt if isinstance(m, dict)]
    if prompt and len(messages) == len(prompt):
        return protocol.Submit(rid=rid, params=params, messages=_chat(messages), tools=tools, client=client,
                               chat_template_kwargs=template_kwargs)
    return protocol.Submit(rid=rid, token_ids=[t for t in prompt if not isinstance(t, dict)], params=params,
                           client=client)


def tokenize_message(prompt: str | list[ChatMessage], add_generation_prompt: bool, tools: Tools | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> protocol.Tokenize:
    """A Tokenize of text or chat messages (with `tools` and `template_kwargs`, as a Submit's), under a
    fresh id its reply comes back with."""
    rid = uuid.uuid4().hex
    if isinstance(prompt, str):
        return protocol.Tokenize(rid=rid, prompt=prompt)
    return protocol.Tokenize(rid=rid, messages=_chat(prompt), add_generation_prompt=add_generation_prompt,
                             tools=tools, chat_template_kwargs=template_kwargs)


def detokenize_message(token_ids: list[int]) -> protocol.Detokenize:
    return protocol.Detokenize(rid=uuid.uuid4().hex, token_ids=token_ids)


def _chat(messages: list[ChatMessage]) -> list[protocol.ChatMessage]:
    return [protocol.ChatMessage(role=m["role"], content=m.get("content") or "", tool_calls=m.get("tool_calls"),
                                 tool_call_id=m.get("tool_call_id"), name=m.get("name"),
                                 reasoning_content=m.get("reasoning_content")) for m in messages]


def route(msg: Reply) -> Key | None:
    """Which waiter a reply belongs to: a request's stream, an abort, a ping, an info (None: nobody)."""
    if isinstance(msg, (Delta, Final, Tokens, Text)):
        return ("req", msg.rid)
    if isinstance(msg, Aborted):
        return ("abort", msg.rid)
    if isinstance(msg, Description):
        return ("describe", msg.rid)
    if isinstance(msg, Error):
        return ("abort" if msg.code == "unknown_request" else "req", msg.rid) if msg.rid is not None else None
    if isinstance(msg, Pong):
        return ("pong", msg.nonce)
    if isinstance(msg, Info):
        return ("info", None)
    if isinstance(msg, ShuttingDown):
        return ("shutdown", None)
    return None  # Heartbeat: its arrival alone is the point


def decode(data: bytes) -> list[Reply]:
    """The replies in one frame: a step's `Outputs` unpacked into its Deltas and Finals, any other reply
    alone, nothing for bytes that are not a reply (skipped: only the engine should be talking)."""
    try:
        msg = protocol.decode_engine(data)
    except protocol.DecodeError:
        return []
    return list(msg.items) if isinstance(msg, protocol.Outputs) else [msg]


def reply_as(msg: Reply, expect: type[T]) -> T:
    """`msg` as the reply a call expects; an Error reply (or a reply of another kind) raises EngineError."""
    if isinstance(msg, expect):
        return msg
    raise _refusal(msg, expect.__name__)


def _refusal(msg: Reply, expected: str) -> EngineError:
    if isinstance(msg, Error):
        return EngineError(msg.code, msg.message, msg.rid)
    return EngineError("internal", f"expected {expected}, got a {type(msg).__name__} reply")


class Box:
    """Where the replies for one key wait. Callers waiting on the same key (two `info()` calls) share
    it: each sent its own request, so each takes one reply. An asyncio transport waits on `arrived`
    (set whenever there is something to take); a blocking one reads the socket itself."""

    __slots__ = ("arrived", "failure", "items", "users")

    def __init__(self, arrived: asyncio.Event | None) -> None:
        self.items: deque[Reply] = deque()
        self.users = 0
        self.failure: Failure | None = None
        self.arrived = arrived

    def wake(self) -> None:
        if self.arrived is not None:
            self.arrived.set()


class Mailroom:
    """The open boxes and the connection's state as far as replies go."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout  # how long the connection may stay silent while someone waits
        self.refused = False  # the engine refused this client's handshake: final for this connection
        self.connection_lost = False  # the connection broke and nothing has come from the engine since
        self.max_message_bytes: int | None = None  # the engine's limit per message, once an Info told it
        self.boxes: dict[Key, Box] = {}
        # Replies nobody waits for and nobody may get: the answer to the abort an abandoned stream sent
        # (a later `abort` of the same rid must get its own answer, not that one).
        self.unclaimed: collections.Counter[Key] = collections.Counter()

    def abandoned(self, rid: str) -> None:
        """An abandoned stream sent an abort for `rid`: its answer is dropped when it comes."""
        self.unclaimed[("abort", rid)] += 1

    def open(self, key: Key, arrived: asyncio.Event | None = None) -> Box:
        """Start filing replies for `key`; a connection failure from now on fails its waits."""
        box = self.boxes.get(key)
        if box is None:
            box = self.boxes[key] = Box(arrived)
        box.users += 1
        return box

    def close(self, key: Key) -> None:
        box = self.boxes.get(key)
        if box is not None:
            box.users -= 1
            if not box.users:
                del self.boxes[key]

    def file(self, data: bytes) -> None:
        self.connection_lost = False
        for msg in decode(data):
            if isinstance(msg, Info) and isinstance(limit := msg.config.get("max_message_bytes"), int):
                self.max_message_bytes = limit
            key = route(msg)
            if key is not None and self.unclaimed[key]:
                self.unclaimed[key] -= 1
                if not self.unclaimed[key]:
                    del self.unclaimed[key]
                continue
            box = self.boxes.get(key) if key is not None else None
            if box is not None:
                box.items.append(msg)
                box.wake()

    def fail_all(self, failure: Failure) -> None:
        """Every open box fails once it is empty: the connection broke or stayed silent too long.
        Boxes opened later are not touched (ZeroMQ reconnects by itself)."""
        self.connection_lost |= failure == "lost"
        for box in self.boxes.values():
            box.failure = failure
            box.wake()

    def take(self, box: Box) -> Reply | None:
        """The box's next reply; None if there is none yet; raises its failure once it is empty."""
        if box.items:
            return box.items.popleft()
        if box.failure == "lost":
            raise self.lost()
        if box.failure == "silent":
            raise self.silent(self.timeout)
        return None

    def lost(self) -> EngineUnavailable:
        if self.refused:
            return EngineRefused(f"the engine at {self.address} refused this client: wrong or missing auth token "
                                 f"(give the engine's --auth-token, or set {AUTH_ENV})")
        return EngineUnavailable(f"the engine at {self.address} closed the connection (it stopped or died, "
                                 f"dropped this client, or wants an auth token); requests in flight are lost")

    def silent(self, timeout: float) -> EngineUnavailable:
        return EngineUnavailable(f"no message from the engine at {self.address} for {timeout:g}s")

    def unsendable(self, timeout: float) -> EngineUnavailable:
        """Why a send found no connection for `timeout` seconds: the engine refused this client, or none."""
        if self.refused:
            return self.lost()
        return EngineUnavailable(f"could not hand a message to the engine at {self.address} for {timeout:g}s "
                                 f"(no connection to it)")

    def check_new_stream(self, msg: protocol.Submit) -> Key:
        """The key of a request about to be submitted; refused here if this client streams it already
        (the engine's refusal would end the live stream), or if the engine would refuse its size."""
        key = ("req", msg.rid)
        if key in self.boxes:
            raise EngineError("duplicate_request", f"request id {msg.rid!r} is live on this client", msg.rid)
        self.encode(msg)
        return key

    def encode(self, msg: msgspec.Struct) -> bytes:
        """`msg` as the frame to send; EngineError, before anything is sent, for a message the engine
        could only refuse: larger than its limit (one connection carries every stream of this client, and
        refusals cost the engine a read of the whole frame), or with values MessagePack cannot carry."""
        rid = getattr(msg, "rid", None)
        try:
            data = protocol.encode(msg)
        except (OverflowError, ValueError) as e:  # an int beyond 64 bits, a lone surrogate in a string
            raise EngineError("invalid_request", f"the message cannot be encoded: {e}", rid) from None
        if self.max_message_bytes is not None and len(data) > self.max_message_bytes:
            raise EngineError("too_large", f"this request is {len(data):,} bytes as a message to the engine, more "
                                           f"than its limit of {self.max_message_bytes:,} (--max-message-bytes)", rid)
        return data


class StatsFeed:
    """Stats whose page map paints every KV page. A snapshot's page runs may be only the changes since the
    newest one that listed every page (protocol.Pages), so the feed reads every snapshot in order (the
    subscriber does not conflate), keeps that complete one, and lays later changes over it."""

    def __init__(self) -> None:
        self._full: Stats | None = None

    def take(self, frames: list[bytes]) -> Stats | None:
        """The newest of these snapshots with every page painted; None while the complete list the
        changes build on has not come (a new subscriber's comes within a moment)."""
        newest = None
        for data in frames:
            newest = self._add(protocol.decode_stats(data)) or newest
        return newest

    def _add(self, stats: Stats) -> Stats | None:
        pages, full = stats.pages, self._full
        if pages.base == stats.seq:
            self._full = stats
            return stats
        # the same engine (a restarted one numbers from 1 again): it started at the same moment
        if full is None or full.seq != pages.base or abs(_started(full) - _started(stats)) > 1.0:
            return None
        shift = len(full.pages.owners)
        changes = [PageRun(r.start, r.length, r.state, r.owner + shift) if r.owner >= 0 else r for r in pages.runs]
        return msgspec.structs.replace(stats, pages=msgspec.structs.replace(
            pages, base=stats.seq, runs=full.pages.runs + changes, owners=full.pages.owners + pages.owners))


def _started(stats: Stats) -> float:
    return stats.time - stats.uptime


class Stream:
    """One request's stream: it is over at its Final or at a refusal. A stream left before that was
    abandoned (a break, a cancelled task, a lost connection), and its transport aborts the request,
    so an abandoned stream never keeps generating."""

    def __init__(self, rid: str, box: Box) -> None:
        self.rid, self.box = rid, box
        self.done = False

    def accept(self, msg: Reply) -> Output:
        """The next output; EngineError if the engine refused the request (which ends the stream)."""
        if isinstance(msg, (Delta, Final)):
            self.done = isinstance(msg, Final)
            return msg
        self.done = True
        raise _refusal(msg, "a Delta or a Final")

    @property
    def abandoned(self) -> bool:
        return not self.done
