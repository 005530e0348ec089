"""The engine process: a ROUTER socket for requests and their streams, an XPUB socket for live stats,
and the step loop in between (overlapped or not, see engine/loop.py).

The loop blocks on the socket only when the scheduler has nothing to do; otherwise it drains
whatever messages arrived and runs the next step. Every message is validated; a bad one gets an
`Error` reply and the engine carries on. A client that disappears (a send to it fails: ROUTER is
in mandatory mode, so a vanished peer is an error, not a silent drop) has its requests aborted,
which frees their request slots and KV pages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

import engine
from engine.config import DEMO_MODEL_DIR, EngineConfig
from engine.llm import LLM
from engine.outputs import Delta, StepResult
from engine.request import Req, SamplingParams
from engine.service import protocol
from engine.service.addresses import (
    AddressError,
    check_bindable,
    default_address,
    remove_stale_ipc,
    split,
    stats_address,
)
from engine.service.client import probe
from engine.service.stats import StatsRecorder

log = logging.getLogger(__name__)

STATS_INTERVAL = 0.1  # publish at least this often (seconds) ...
STATS_MIN_INTERVAL = 0.05  # ... and on a change of state, but not more often than this
HEARTBEAT_INTERVAL = 1.0  # clients with live requests hear from us at least this often
MAX_DRAIN = 256  # messages handled between two steps, so a flood cannot starve generation
MAX_RID_LEN = 256
SEND_HWM = 100_000  # queued messages per client; a client this far behind is treated as gone


@dataclass
class ServerOptions:
    """Server-side limits, on top of EngineConfig's engine limits."""

    address: str | None = None
    allow_remote: bool = False
    max_waiting_requests: int = 1024
    max_message_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1 or self.max_message_bytes < 1024:
            raise ValueError("max_waiting_requests must be >= 1 and max_message_bytes >= 1024")


class StartupError(Exception):
    """The engine could not start: address taken or not allowed, model missing or unloadable."""


class Refused(Exception):
    """A message the engine will not act on; becomes an Error reply with this code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Owned:
    identity: bytes
    req: Req


class Sockets:
    """The engine's two listening sockets, bound before the model loads so a taken address fails fast."""

    def __init__(self, address: str, options: ServerOptions) -> None:
        check_bindable(address, options.allow_remote)
        running = probe(address)
        if running is not None:
            raise AddressError(f"an engine (pid {running.pid}, minichat {running.version}) already answers at "
                               f"{address}; stop it with `minichat stop` or choose another --address")
        remove_stale_ipc(address)
        self.address, self.stats_address = address, stats_address(address)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes)
        self.router.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.router.setsockopt(zmq.HEARTBEAT_IVL, 2000)  # transport-level: notices half-open tcp peers
        self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        self.pub = self.ctx.socket(zmq.XPUB)  # XPUB: it tells us whether anyone subscribes
        self.pub.setsockopt(zmq.SNDHWM, 16)  # a slow dashboard misses snapshots rather than queueing them
        self.pub.setsockopt(zmq.LINGER, 0)
        for sock, addr in ((self.router, self.address), (self.pub, self.stats_address)):
            try:
                sock.bind(addr)
            except zmq.ZMQError as e:
                self.close(linger=0)
                raise AddressError(f"cannot listen on {addr}: {e.strerror}") from e

    def close(self, linger: int) -> None:
        """Close both sockets (waiting up to `linger` ms to deliver final replies) and remove ipc files."""
        self.router.close(linger=linger)
        self.pub.close(linger=0)
        self.ctx.term()
        for addr in (self.address, self.stats_address):
            scheme, path = split(addr)
            if scheme == "ipc":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


class EngineServer:
    """Runs an LLM behind the sockets until `request_stop()` (signal-safe)."""

    def __init__(self, llm: LLM, sockets: Sockets, options: ServerOptions) -> None:
        self.llm = llm
        self.sockets = sockets
        self.router, self.pub = sockets.router, sockets.pub
        self.options = options
        self.stats = StatsRecorder(llm)
        self.owners: dict[str, _Owned] = {}
        self._last_sent: dict[bytes, float] = {}
        self._stop = False
        self._dirty = True
        self._was_idle = True
        self._last_publish = 0.0
        self._last_sweep = time.monotonic()
        self._topics: set[bytes] = set()  # subscribed stats topics: XPUB reports each one's first subscribe
        # and last unsubscribe, so this is empty exactly when nobody listens
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self.pub, zmq.POLLIN)

    def request_stop(self) -> None:
        self._stop = True

    def run(self) -> None:
        """Receive (blocking only when idle) -> step -> deliver. With `EngineConfig.overlap` a step returns
        the previous batch, processed while the next one runs in the model worker, so detokenising,
        sending and receiving all happen off the model's critical path (the seed's overlap_loop)."""
        log.info("engine ready: model %s, %d KV pages x %d tokens, %d request slots; listening on %s, "
                 "stats on %s (pid %d)", self.llm.model_path, self.llm.num_pages, self.llm.config.page_size,
                 self.llm.config.max_running_requests, self.sockets.address, self.sockets.stats_address,
                 os.getpid())
        try:
            while not self._stop:
                self.llm.check_health()  # a dead tensor-parallel rank stops the engine even when idle
                busy = self.llm.has_unfinished()
                self._receive(0 if busy else self._ms_until_publish())
                if self.llm.has_unfinished():
                    self._deliver(self.llm.step(self.llm.config.overlap))
                self._sweep_clients()
                self._publish()
        except Exception as e:  # the engine is going down: say so to everyone waiting, not just the log
            for rid, owned in list(self.owners.items()):
                self._send(owned.identity, protocol.Error(code="internal", message=f"the engine failed: {e!r}",
                                                          rid=rid))
            raise
        self._shutdown()

    # -- receiving --------------------------------------------------------------------------------
    def _ms_until_publish(self) -> int:
        return max(0, int((self._last_publish + STATS_INTERVAL - time.monotonic()) * 1000) + 1)

    def _receive(self, timeout_ms: int) -> None:
        ready = dict(self._poller.poll(timeout_ms))
        if self.pub in ready:
            self._read_subscriptions()
        if self.router not in ready:
            return
        for _ in range(MAX_DRAIN):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        if len(body) != 1:
            self._error(identity, "bad_message", f"send one frame per message (got {len(body)}); use a DEALER socket")
            return
        try:
            msg = protocol.decode_client(body[0])
        except protocol.DecodeError as e:
            self._error(identity, "bad_message", f"not a valid message: {e}", protocol.salvage_rid(body[0]))
            return
        rid = getattr(msg, "rid", None)
        try:
            self._dispatch(identity, msg)
        except Refused as e:
            self._error(identity, e.code, str(e), rid)
        except Exception as e:  # a bug handling one message must not take down everyone's requests
            log.exception("internal error handling %s", type(msg).__name__)
            self._error(identity, "internal", f"{type(e).__name__}: {e}", rid)

    def _dispatch(self, identity: bytes, msg: protocol.ClientMessage) -> None:
        if isinstance(msg, protocol.Submit):
            self._submit(identity, msg)
        elif isinstance(msg, protocol.Abort):
            self._abort(identity, msg.rid)
        elif isinstance(msg, protocol.Ping):
            self._send(identity, protocol.Pong(nonce=msg.nonce, version=engine.__version__, pid=os.getpid()))
        else:
            self._send(identity, self._info())

    def _submit(self, identity: bytes, msg: protocol.Submit) -> None:
        rid = msg.rid
        if not rid or len(rid) > MAX_RID_LEN:
            raise Refused("invalid_request", f"rid must be a non-empty string of at most {MAX_RID_LEN} characters")
        if rid in self.owners or self.llm.request(rid) is not None:
            raise Refused("duplicate_request", f"request id {rid!r} is already in use; choose another")
        waiting = self.llm.num_waiting
        if waiting >= self.options.max_waiting_requests:
            raise Refused("overloaded", f"the waiting queue is full ({waiting} requests); retry later")
        given = [p for p in (msg.prompt, msg.messages, msg.token_ids) if p is not None]
        if len(given) != 1:
            raise Refused("invalid_request", "give exactly one of prompt (text), messages (chat) or token_ids")
        prompt = given[0]
        if msg.messages is not None:
            prompt = [msgspec.structs.asdict(m) for m in msg.messages]
        try:
            params = SamplingParams(**msgspec.structs.asdict(msg.params))
        except ValueError as e:
            raise Refused("invalid_params", str(e)) from e
        try:
            self.llm.add_request(prompt, params, rid)  # type: ignore[arg-type]
        except ValueError as e:
            raise Refused("invalid_request", str(e)) from e
        self.owners[rid] = _Owned(identity, self.llm.request(rid))  # type: ignore[arg-type]
        self.stats.submitted += 1
        self._dirty = True

    def _abort(self, identity: bytes, rid: str) -> None:
        try:
            self._abort_request(rid)
        except ValueError as e:
            raise Refused("unknown_request", str(e)) from e
        self._send(identity, protocol.Aborted(rid=rid))

    def _abort_request(self, rid: str) -> None:
        """Abort now: the scheduler counts it at once and frees the slot and pages as soon as no step in
        flight uses them (at once, or after the step running now); the Final goes out after the next step."""
        self.llm.abort(rid)
        self._dirty = True

    def _info(self) -> protocol.Info:
        config = dataclasses.asdict(self.llm.config)
        config.update(max_waiting_requests=self.options.max_waiting_requests,
                      max_message_bytes=self.options.max_message_bytes, allow_remote=self.options.allow_remote)
        return protocol.Info(version=engine.__version__, pid=os.getpid(), host=socket.gethostname(),
                             model=str(self.llm.model_path), address=self.sockets.address,
                             stats_address=self.sockets.stats_address, max_seq_len=self.llm.max_seq_len,
                             num_pages=self.llm.num_pages, config=config)

    # -- sending ----------------------------------------------------------------------------------
    def _send(self, identity: bytes, msg: msgspec.Struct) -> bool:
        """Send to one client; if it is gone (or hopelessly behind), abort its requests."""
        try:
            self.router.send_multipart([identity, protocol.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._drop_client(identity, e.strerror)
            return False
        self._last_sent[identity] = time.monotonic()
        return True

    def _error(self, identity: bytes, code: str, message: str, rid: str | None = None) -> None:
        log.info("refused a message: [%s] %s", code, message)
        self.stats.errors += 1
        self._dirty = True
        self._send(identity, protocol.Error(code=code, message=message, rid=rid))

    def _drop_client(self, identity: bytes, why: str) -> None:
        rids = [rid for rid, owned in self.owners.items() if owned.identity == identity]
        for rid in rids:
            del self.owners[rid]
            with contextlib.suppress(ValueError):  # it may have finished in the step being delivered
                self._abort_request(rid)
        self._last_sent.pop(identity, None)
        log.warning("client %s is gone (%s); aborted its %d request(s)", identity.hex(), why, len(rids))

    def _deliver(self, result: StepResult) -> None:
        """One `Outputs` message per client, carrying the step's Delta or Final of each of its requests."""
        self.stats.record_step(result)
        self._dirty = True
        per_client: dict[bytes, list[protocol.Delta | protocol.Final]] = {}
        for delta in result.deltas:
            owned = self.owners.get(delta.rid)
            if owned is None:
                continue  # its client is gone
            if delta.finish_reason is None:
                item = protocol.Delta(rid=delta.rid, text=delta.text, token_ids=delta.token_ids)
            else:
                del self.owners[delta.rid]
                item = _final(delta, owned.req)
            per_client.setdefault(owned.identity, []).append(item)
        for identity, items in per_client.items():
            self._send(identity, protocol.Outputs(items=items))

    def _sweep_clients(self) -> None:
        """Heartbeat clients that have live requests but heard nothing lately; a failed send drops them."""
        now = time.monotonic()
        if now - self._last_sweep < HEARTBEAT_INTERVAL:
            return
        self._last_sweep = now
        live = {owned.identity for owned in self.owners.values()}
        self._last_sent = {i: t for i, t in self._last_sent.items() if i in live}
        for identity in live:
            if now - self._last_sent.get(identity, 0.0) >= HEARTBEAT_INTERVAL:
                self._send(identity, protocol.Heartbeat())

    def _read_subscriptions(self) -> None:
        """Track whether any stats subscriber is connected; a new one gets a snapshot at once."""
        while True:
            try:
                event = self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if event[:1] == b"\x01":
                self._topics.add(event[1:])
                self._dirty, self._last_publish = True, 0.0
            else:
                self._topics.discard(event[1:])

    def _publish(self, force: bool = False) -> None:
        """While someone subscribes: a complete snapshot ~10x a second, and on changes (rate-limited), at
        once when busy<->idle flips. With no subscriber no snapshot is even built."""
        if not self._topics:
            return
        now = time.monotonic()
        since = now - self._last_publish
        idle = not self.llm.has_unfinished()
        changed = self._dirty and (since >= STATS_MIN_INTERVAL or idle != self._was_idle)
        if not (force or changed or since >= STATS_INTERVAL):
            return
        with contextlib.suppress(zmq.Again):
            self.pub.send(protocol.encode(self.stats.snapshot()), zmq.NOBLOCK)
        self._last_publish, self._dirty, self._was_idle = now, False, idle

    # -- shutdown ---------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Abort everything in flight, tell each owner with a Final, publish a last snapshot."""
        rids = list(self.owners)
        for rid in rids:
            with contextlib.suppress(ValueError):
                self._abort_request(rid)
        while self.llm.has_unfinished():
            self._deliver(self.llm.step())
        self._publish(force=True)
        log.info("engine stopping: aborted %d in-flight request(s)", len(rids))


def _final(delta: Delta, req: Req) -> protocol.Final:
    arrival = req.arrival_time
    return protocol.Final(
        rid=delta.rid, text=delta.text, token_ids=delta.token_ids, finish_reason=delta.finish_reason or "",
        usage=protocol.Usage(prompt_tokens=req.input_len, completion_tokens=len(req.output_ids),
                             cached_tokens=req.prefix_len),
        timings=protocol.Timings(queue=None if req.admit_time is None else req.admit_time - arrival,
                                 ttft=None if req.first_token_time is None else req.first_token_time - arrival,
                                 total=(req.finish_time or time.monotonic()) - arrival))


def load_llm(config: EngineConfig) -> LLM:
    """The LLM for `config`, with a clear error when the embedded demo model has not been built."""
    if config.model is None and not (DEMO_MODEL_DIR / "config.json").is_file():
        raise ValueError(f"no --model given, and the embedded demo model is not built yet ({DEMO_MODEL_DIR}); "
                         f"pass --model PATH (an HF checkpoint directory) or build it with "
                         f"scripts/train_demo_model.py")
    return LLM(**dataclasses.asdict(config))


def run_server(config: EngineConfig, options: ServerOptions) -> None:
    """`minichat serve`: claim the address, load the model, serve until SIGINT/SIGTERM, then clean up.

    Raises StartupError (with a message meant for the operator) if it cannot get going.
    """
    server: EngineServer | None = None

    def on_signal(signum: int, _frame: object) -> None:
        if server is None:  # still loading: nothing in flight, just leave (sockets are closed below)
            raise SystemExit(128 + signum)
        server.request_stop()

    _install(on_signal)
    try:
        sockets = Sockets(options.address or default_address(), options)
    except (AddressError, OSError) as e:
        raise StartupError(str(e)) from e
    try:
        try:
            llm = load_llm(config)
        except (ValueError, OSError) as e:
            raise StartupError(f"cannot load the model: {e}") from e
        try:
            server = EngineServer(llm, sockets, options)
            server.run()
        finally:
            llm.close()
    finally:
        sockets.close(linger=2000)


def _install(handler: Callable[[int, object], None]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
