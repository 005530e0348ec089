"""The engine process: a ROUTER socket for requests and their streams, an XPUB socket for live stats,
and the step loop in between (overlapped or not, see engine/loop.py).

The loop blocks on the socket only when the scheduler has nothing to do; otherwise it drains
whatever messages arrived and runs the next step. Every message is validated; a bad one (or any
exception while handling one) gets an `Error` reply and the engine carries on. Text prompts are
tokenized on a worker thread (tokenizers releases the GIL), so a huge prompt never stalls the loop,
and ping / shutdown stay answered under any load. A client that disappears (a send to it fails: ROUTER is
in mandatory mode, so a vanished peer is an error, not a silent drop) has its requests aborted,
which frees their request slots and KV pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

import engine
from engine.config import DEMO_MODEL_DIR, EngineConfig
from engine.llm import LLM
from engine.outputs import Delta, StepResult
from engine.request import PromptTooLong, Req, SamplingParams
from engine.service import protocol
from engine.service.addresses import (
    AddressError,
    check_bindable,
    default_address,
    remove_stale_ipc,
    split,
    stats_address,
)
from engine.service.client import AUTH_USER, EngineRefused, probe
from engine.service.connections import ConnectionCap, connection_cap, raise_fd_limit
from engine.service.stats import StatsRecorder
from engine.tokenizer import max_prompt_chars

log = logging.getLogger(__name__)

STATS_INTERVAL = 0.1  # publish at least this often (seconds) ...
STATS_MIN_INTERVAL = 0.05  # ... and on a change of state, but not more often than this
HEARTBEAT_INTERVAL = 1.0  # clients with live requests hear from us at least this often
MAX_DRAIN = 256  # messages handled between two steps, so a flood cannot starve generation
MAX_RID_LEN = 256
MAX_ECHOED_RID = 1024  # an invalid rid longer than this is not echoed back in the Error
SEND_BUFFER = 128 << 10  # kernel send buffer per connection (bytes)
SUBSCRIPTION_BYTES = 64  # largest accepted stats subscription message (clients subscribe to "")
HANDSHAKE_MS = 5000  # a connection that has not completed the ZeroMQ handshake by then is closed


@dataclass
class ServerOptions:
    """Server-side limits, on top of EngineConfig's engine limits."""

    address: str | None = None
    allow_remote: bool = False
    max_waiting_requests: int = 1024
    max_message_bytes: int = 1 << 20
    auth_token: str | None = None
    max_connections: int = 4096
    client_buffer_messages: int = 1000

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1 or self.max_message_bytes < 1024:
            raise ValueError("max_waiting_requests must be >= 1 and max_message_bytes >= 1024")
        if self.max_connections < 1 or self.client_buffer_messages < 1:
            raise ValueError("max_connections and client_buffer_messages must be >= 1")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("an auth token must not be empty")


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


@dataclass
class _Encoding:
    """A request whose text prompt the tokenizer worker is still turning into token ids."""

    identity: bytes
    ids: Future[list[int]]
    params: SamplingParams
    arrival: float


class Sockets:
    """The engine's two listening sockets, bound before the model loads so a taken address fails fast.

    Both are created owner-only (0600, in a 0700 directory) whatever the umask; with an auth token they
    accept only ZeroMQ PLAIN handshakes carrying it (checked by a ZAP handler thread)."""

    def __init__(self, address: str, options: ServerOptions) -> None:
        check_bindable(address, options.allow_remote, options.auth_token is not None)
        try:
            running = probe(address, auth_token=options.auth_token)
        except EngineRefused as e:
            raise AddressError(f"{e}: an engine already answers there; stop it or choose another --address") from e
        if running is not None:
            raise AddressError(f"an engine (pid {running.pid}, minichat {running.version}) already answers at "
                               f"{address}; stop it with `minichat stop` or choose another --address")
        remove_stale_ipc(address)  # also creates the socket's directory, mode 0700
        self.address, self.stats_address = address, stats_address(address)
        self.ctx = zmq.Context()
        self.auth: ThreadAuthenticator | None = None
        if options.auth_token is not None:
            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_plain(domain="*", passwords={AUTH_USER: options.auth_token})
        # libzmq numbers anonymous peers from rand(), which nobody seeds: every engine's first peer id
        # was 00 6b8b4567, and a peer that claimed the next ids itself made libzmq abort on the
        # collision. Seeded, the ids a ROUTER assigns cannot be guessed.
        ctypes.CDLL(None).srand(secrets.randbits(32))
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes)
        self.router.setsockopt(zmq.SNDHWM, options.client_buffer_messages)
        self.router.setsockopt(zmq.SNDBUF, SEND_BUFFER)
        self.router.setsockopt(zmq.HEARTBEAT_IVL, 2000)  # transport-level: notices half-open tcp peers
        self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        self.pub = self.ctx.socket(zmq.XPUB)  # XPUB: it tells us whether anyone subscribes
        # A subscription is stored (by libzmq and in _topics): MiB-long ones cost hundreds of MiB.
        self.pub.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_BYTES)
        self.pub.setsockopt(zmq.SNDHWM, 16)  # a slow dashboard misses snapshots rather than queueing them
        self.pub.setsockopt(zmq.LINGER, 0)
        for sock in (self.router, self.pub):
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
            if options.auth_token is not None:
                sock.setsockopt(zmq.PLAIN_SERVER, 1)
        fd_limit = raise_fd_limit()
        self.cap = ConnectionCap([self.router, self.pub], connection_cap(options.max_connections, fd_limit))
        self.cap.start()
        old_umask = os.umask(0o077)  # the socket files are created by bind: owner-only from the start
        try:
            for sock, addr in ((self.router, self.address), (self.pub, self.stats_address)):
                try:
                    sock.bind(addr)
                except zmq.ZMQError as e:
                    self.close(linger=0)
                    raise AddressError(f"cannot listen on {addr}: {e.strerror}") from e
                scheme, path = split(addr)
                if scheme == "ipc":
                    os.chmod(path, 0o600)  # 0700 from bind under umask 077; nothing executes a socket
        finally:
            os.umask(old_umask)
        log.info("accepting up to %d connections (open-file limit %d)", self.cap.cap, fd_limit)

    def close(self, linger: int) -> None:
        """Close both sockets (waiting up to `linger` ms to deliver final replies) and remove ipc files."""
        self.cap.stop()
        self.router.close(linger=linger)
        self.pub.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
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
        self.encoding: dict[str, _Encoding] = {}
        self._tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._max_prompt_chars = max_prompt_chars(llm.tokenizer, llm.max_seq_len)
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
                self._receive(0 if busy else self._idle_wait_ms())
                self._admit_encoded()
                if self.llm.has_unfinished():
                    self._deliver(self.llm.step(self.llm.config.use_overlap))
                self._sweep_clients()
                self._publish()
        except Exception as e:  # the engine is going down: say so to everyone waiting, not just the log
            for rid, owned in list(self.owners.items()):
                self._send(owned.identity, protocol.Error(code="internal", message=f"the engine failed: {e!r}",
                                                          rid=rid))
            raise
        self._shutdown()

    # -- receiving --------------------------------------------------------------------------------
    def _idle_wait_ms(self) -> int:
        """How long an idle loop may block on the sockets: until the next stats snapshot is due while
        someone subscribes, else a heartbeat interval (the health check still runs that often)."""
        if self.encoding:
            return 5
        if self._topics:
            return max(0, int((self._last_publish + STATS_INTERVAL - time.monotonic()) * 1000) + 1)
        return int(HEARTBEAT_INTERVAL * 1000)

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
            try:
                self._handle(frames)
            except Exception as e:  # whatever one message does, it must not end the engine for everyone
                log.exception("internal error handling a message")
                self._error(frames[0], "internal", f"{type(e).__name__}: {e}")

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
        elif isinstance(msg, protocol.Shutdown):
            log.info("shutdown requested by client %s", identity.hex())
            self._send(identity, protocol.ShuttingDown(pid=os.getpid()))
            self.request_stop()
        else:
            self._send(identity, self._info())

    def _submit(self, identity: bytes, msg: protocol.Submit) -> None:
        rid = msg.rid
        if not rid or len(rid) > MAX_RID_LEN:
            raise Refused("invalid_request", f"rid must be a non-empty string of at most {MAX_RID_LEN} characters")
        if rid in self.owners or rid in self.encoding or self.llm.request(rid) is not None:
            raise Refused("duplicate_request", f"request id {rid!r} is already in use; choose another")
        waiting = self.llm.num_waiting + len(self.encoding)
        if waiting >= self.options.max_waiting_requests:
            raise Refused("overloaded", f"the waiting queue is full ({waiting} requests); retry later")
        given = [p for p in (msg.prompt, msg.messages, msg.token_ids) if p is not None]
        if len(given) != 1:
            raise Refused("invalid_request", "give exactly one of prompt (text), messages (chat) or token_ids")
        try:
            params = SamplingParams(**msgspec.structs.asdict(msg.params))
        except ValueError as e:
            raise Refused("invalid_params", str(e)) from e
        if msg.token_ids is not None:
            self._add(identity, rid, msg.token_ids, params, time.monotonic())
        else:  # text: tokenized off the loop, after a size check that costs nothing
            chars = len(msg.prompt) if msg.prompt is not None else sum(len(m.content) for m in msg.messages or ())
            if chars > self._max_prompt_chars:
                raise Refused("prompt_too_long", f"the prompt has {chars} characters, more than the "
                                                 f"{self.llm.max_seq_len - 1} tokens that fit could spell")
            prompt = msg.prompt if msg.prompt is not None else [msgspec.structs.asdict(m) for m in msg.messages or ()]
            self.encoding[rid] = _Encoding(identity, self._tokenizer.submit(self.llm.encode_prompt, prompt), params,
                                           time.monotonic())
        self.stats.submitted += 1
        self._dirty = True

    def _add(self, identity: bytes, rid: str, ids: list[int], params: SamplingParams, arrival: float) -> None:
        try:
            self.llm.add_request(ids, params, rid)
        except PromptTooLong as e:
            raise Refused("prompt_too_long", str(e)) from e
        except ValueError as e:
            raise Refused("invalid_request", str(e)) from e
        req = self.llm.request(rid)
        assert req is not None
        req.arrival_time = arrival  # timings count the time spent tokenizing
        self.owners[rid] = _Owned(identity, req)

    def _admit_encoded(self) -> None:
        """Queue the requests whose prompts are tokenized, in arrival order (one worker: FIFO)."""
        while self.encoding:
            rid, enc = next(iter(self.encoding.items()))
            if not enc.ids.done():
                return
            del self.encoding[rid]
            try:
                self._add(enc.identity, rid, enc.ids.result(), enc.params, enc.arrival)
            except ValueError as e:
                self._error(enc.identity, "invalid_request", str(e), rid)
            except Refused as e:
                self._error(enc.identity, e.code, str(e), rid)
            except Exception as e:
                log.exception("internal error tokenizing request %s", rid)
                self._error(enc.identity, "internal", f"{type(e).__name__}: {e}", rid)

    def _abort(self, identity: bytes, rid: str) -> None:
        try:
            self._abort_request(rid)
        except ValueError as e:
            raise Refused("unknown_request", str(e)) from e
        self._send(identity, protocol.Aborted(rid=rid))

    def _abort_request(self, rid: str) -> None:
        """Abort now: the scheduler counts it at once and frees the slot and pages as soon as no step in
        flight uses them (at once, or after the step running now); the Final goes out after the next step.
        A request still being tokenized holds nothing: its Final goes out at once."""
        enc = self.encoding.pop(rid, None)
        if enc is not None:
            enc.ids.cancel()
            self.stats.unscheduled_aborts += 1
            self._send(enc.identity, protocol.Outputs(items=[_final_unstarted(rid, enc.arrival)]))
        else:
            self.llm.abort(rid)
        self._dirty = True

    def _info(self) -> protocol.Info:
        config = dataclasses.asdict(self.llm.config)
        config.update(max_waiting_requests=self.options.max_waiting_requests,
                      max_message_bytes=self.options.max_message_bytes, allow_remote=self.options.allow_remote)
        return protocol.Info(version=engine.__version__, pid=os.getpid(), host=socket.gethostname(),
                             model=str(self.llm.model_path), address=self.sockets.address,
                             stats_address=self.sockets.stats_address, max_seq_len=self.llm.max_seq_len,
                             num_pages=self.llm.num_pages, config=config, execution=self.llm.execution)

    # -- sending ----------------------------------------------------------------------------------
    def _send(self, identity: bytes, msg: msgspec.Struct) -> bool:
        """Send to one client; if it is gone (or hopelessly behind), abort its requests."""
        try:
            self.router.send_multipart([identity, protocol.encode(msg)], zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: it has not read its last client_buffer_messages replies
            self._drop_client(identity, f"it fell {self.options.client_buffer_messages} messages behind "
                                        f"(it does not read its replies)")
            return False
        except zmq.ZMQError as e:
            unreachable = e.errno == zmq.EHOSTUNREACH
            why = "it disconnected, or stopped reading and missed its heartbeats" if unreachable else e.strerror
            self._drop_client(identity, why)
            return False
        self._last_sent[identity] = time.monotonic()
        return True

    def _error(self, identity: bytes, code: str, message: str, rid: str | None = None) -> None:
        log.info("refused a message: [%s] %s", code, message)
        self.stats.errors += 1
        self._dirty = True
        if rid is not None and len(rid) > MAX_ECHOED_RID:
            rid = None
        self._send(identity, protocol.Error(code=code, message=message, rid=rid))

    def _drop_client(self, identity: bytes, why: str) -> None:
        for rid in [rid for rid, enc in self.encoding.items() if enc.identity == identity]:
            self.encoding.pop(rid).ids.cancel()
            self.stats.unscheduled_aborts += 1
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
        live = {owned.identity for owned in self.owners.values()} | {e.identity for e in self.encoding.values()}
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
        rids = [*self.owners, *self.encoding]
        for rid in rids:
            with contextlib.suppress(ValueError):
                self._abort_request(rid)
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
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


def _final_unstarted(rid: str, arrival: float) -> protocol.Final:
    """The Final of a request aborted before it reached the scheduler."""
    return protocol.Final(rid=rid, text="", token_ids=[], finish_reason="abort",
                          usage=protocol.Usage(prompt_tokens=0, completion_tokens=0, cached_tokens=0),
                          timings=protocol.Timings(queue=None, ttft=None, total=time.monotonic() - arrival))


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
