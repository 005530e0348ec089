"""The engine process: the step loop between the request socket and the stats publisher (sockets.py,
publisher.py), overlapped or not (see engine/loop.py).

The loop blocks on the socket only when the scheduler has nothing to do; otherwise it drains
whatever messages arrived and runs the next step. Every message is validated; a bad one (or any
exception while handling one) gets an `Error` reply and the engine carries on. Text prompts are
tokenized on a worker thread (tokenizers releases the GIL) and grammars compiled on another (xgrammar
releases it too, within --grammar-time-limit), so neither a huge prompt nor a costly grammar stalls the
loop, and so are `tokenize` / `detokenize` calls; ping / shutdown stay answered under any load. A client
that disappears (a send to it fails: ROUTER is in mandatory mode, so a vanished peer is an error, not
a silent drop) has its requests aborted, which frees their request slots and KV pages. The server keeps
one record per live request, from its Submit to its Final (registry.py); it answers duplicates, aborts,
clients gone and shutdown from there alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import msgspec
import zmq
from transformers import PreTrainedTokenizerBase

import engine
from engine.config import DEMO_MODEL_DIR, EngineConfig
from engine.heap import HeapTrimmer, freeze_loaded
from engine.llm import LLM
from engine.outputs import Final, Output, StepResult, Timings, Usage
from engine.params import invalid_params
from engine.prompt import check_template_kwargs
from engine.reasoning import ThinkMarkers
from engine.request import PromptTooLong
from engine.scheduler.snapshot import WaitingEntry
from engine.service import protocol
from engine.service.addresses import AddressError, default_address
from engine.service.liveness import StepCover
from engine.service.options import ServerOptions
from engine.service.outbox import ClientGone, Outbox
from engine.service.parent import PARENT_ENV, parent_pidfd
from engine.service.publisher import StatsPublisher
from engine.service.registry import GrammarJob, Preparation, Record, Registry
from engine.service.sockets import Sockets
from engine.service.stats import StatsRecorder
from engine.structured import InvalidGrammar
from engine.tokenizer import apply_chat_template, max_prompt_chars
from engine.tools import template_messages

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 1.0  # clients with live requests hear from us at least this often
MAX_DRAIN = 256  # messages handled between two steps, so a flood cannot starve generation
MAX_PREPARING_PER_CLIENT = 64  # requests one client (connection and label) may have tokenizing or compiling at once
MAX_RID_LEN = 256
MAX_ECHOED_RID = 1024  # an invalid rid longer than this is not echoed back in the Error
REMEMBERED_CLIENTS = 4096  # connections whose number ("client 3") is kept once they have no request live


class StartupError(Exception):
    """The engine could not start: address taken or not allowed, model missing or unloadable."""


class Refused(Exception):
    """A message the engine will not act on; becomes an Error reply with this code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Answer:
    """A `tokenize` / `detokenize` call the tokenizer worker is still working on: `reply` is its answer."""

    identity: bytes
    rid: str
    reply: Future[msgspec.Struct]


class EngineServer:
    """Runs an LLM behind the sockets until `request_stop()` (signal-safe)."""

    def __init__(self, llm: LLM, sockets: Sockets, options: ServerOptions) -> None:
        self.llm = llm
        self.sockets = sockets
        self.router = sockets.router
        self.options = options
        self.stats = StatsRecorder(llm, preparing=self._preparing_rows)
        self.publisher = StatsPublisher(sockets.pub, self.stats.snapshot)
        self.requests = Registry()  # every live request, from its Submit to its Final (registry.py)
        self.answering: deque[_Answer] = deque()  # in the order the one tokenizer worker finishes them
        self._writing = False  # KV pages wait at idle for room on their way to disk (`LLM.write_behind`)
        self._heap = HeapTrimmer()  # freed memory back to the OS now and then (engine/heap.py)
        self._tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._grammars = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar", initializer=_yield_cores)
        self._max_prompt_chars = max_prompt_chars(llm.tokenizer, llm.max_seq_len)
        self._last_sent: dict[bytes, float] = {}
        self._outbox = Outbox(self.router, options.client_stall_seconds)
        self._client_numbers: dict[bytes, int] = {}  # connection -> its number, least recently used first
        self._clients_seen = 0
        self._stop = False
        self._last_sweep = time.monotonic()
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(sockets.pub, zmq.POLLIN)
        self._parent = parent_pidfd()  # the launching process, when one started this engine (parent.py)
        if self._parent is not None:
            self._poller.register(self._parent, zmq.POLLIN)
        self._cover = StepCover(self.router, self._reply_during_step, self.requests.owners, HEARTBEAT_INTERVAL)
        # a stop asked for by a signal wakes the idle poll at once (pyzmq resumes a poll a signal interrupted, so
        # the loop would otherwise go on waiting up to a heartbeat interval before it saw the flag)
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_write.setblocking(False)
        self._poller.register(self._wake_read, zmq.POLLIN)

    def request_stop(self) -> None:
        """Leave the loop after this pass (signal-safe: a flag and a byte on the wake-up socket)."""
        self._stop = True
        with contextlib.suppress(OSError):  # a full buffer: a wake-up is already pending
            self._wake_write.send(b"\0")

    def run(self) -> None:
        """Pass after pass (`run_once`) until stopped; then abort what is in flight (`_shutdown`)."""
        execution = self.llm.execution
        log.info("engine ready: model %s, %d KV pages x %d tokens, %d request slots; weights %s, %s, cpu kernels %s; "
                 "listening on %s, stats on %s (pid %d)", self.llm.checkpoint.path, self.llm.num_pages,
                 self.llm.config.kv.page_size, self.llm.config.request_slots, execution["weights"], execution["gemm"],
                 execution["cpu_kernels"], self.sockets.address, self.sockets.stats_address, os.getpid())
        try:
            while not self._stop:
                self.run_once()
            self._shutdown()
        except Exception as e:  # the engine is going down: say so to everyone waiting, not just the log
            for record in self.requests:
                if record.owner is not None:
                    self._send(record.owner, protocol.Error(code="internal", message=f"the engine failed: {e!r}",
                                                            rid=record.rid))
            raise
        finally:
            self._cover.close()
            self._wake_read.close()
            self._wake_write.close()

    def run_once(self) -> None:
        """One pass of the loop: receive (blocking only when idle) -> step -> deliver. With
        `SchedulerConfig.overlap` a step returns the previous batch, processed while the next one runs in the
        model worker, so detokenising, sending and receiving all happen off the model's critical path."""
        self.llm.check_health()  # a dead tensor-parallel rank stops the engine even when idle
        busy = self.llm.has_unfinished()
        self._flush()
        self._receive(0 if busy else self._idle_wait_ms())
        self._admit_prepared()
        self._answer()
        stepping = self.llm.has_unfinished()
        if stepping:
            self._deliver(self._step(self.llm.config.use_overlap))
        else:
            self._writing = self.llm.write_behind()
        self._heap.maybe_trim(worked=stepping)
        self._sweep_clients()
        self.publisher.publish(idle=not self.llm.has_unfinished())

    # -- receiving --------------------------------------------------------------------------------
    def _idle_wait_ms(self) -> int:
        """How long an idle loop may block on the sockets: until the next stats snapshot is due while
        someone subscribes, else a heartbeat interval (the health check still runs that often)."""
        if self.requests.preparing() or self.answering or self._writing or self._outbox.holding:
            return 5
        if self.publisher.listening:
            return self.publisher.wait_ms()
        return int(HEARTBEAT_INTERVAL * 1000)

    def _step(self, overlap: bool = False) -> StepResult:
        """One step, with the socket lent to the liveness thread while it runs; then drop the clients a
        send failed to meanwhile."""
        with self._cover.step():
            result = self.llm.step(overlap)
        while self._cover.gone:
            self._drop_client(*self._cover.gone.popitem())
        return result

    def _reply_during_step(self, msg: protocol.ClientMessage, busy_for: float) -> msgspec.Struct | None:
        """What the liveness thread answers for the loop during a long step: a ping, and the Info (the
        step changes neither); everything else waits for the loop."""
        if isinstance(msg, protocol.Ping):
            return self._pong(msg, busy_for)
        return self._info() if isinstance(msg, protocol.GetInfo) else None

    def _pong(self, ping: protocol.Ping, busy_for: float | None = None) -> protocol.Pong:
        return protocol.Pong(nonce=ping.nonce, version=engine.__version__, pid=os.getpid(), busy_for=busy_for)

    def _receive(self, timeout_ms: int) -> None:
        held = self._cover.held  # messages that arrived during the last long step come first, in order
        for _ in range(min(len(held), MAX_DRAIN)):
            self._handle_safely(held.popleft())
        ready = dict(self._poller.poll(0 if held else timeout_ms))
        if self._parent is not None and self._parent in ready and not self._stop:
            log.warning("the process that started this engine (%s) is gone; stopping", os.environ.get(PARENT_ENV))
            self.request_stop()
        if self.publisher.pub in ready:
            self.publisher.read_subscriptions()
        if self.router not in ready:
            return
        for _ in range(MAX_DRAIN):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle_safely(frames)

    def _handle_safely(self, frames: list[bytes]) -> None:
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
        if len(body[0]) > self.options.max_message_bytes:  # the socket let it in (sockets.py) so that it is answered
            self._error(identity, "too_large", f"the message is {len(body[0]):,} bytes, more than this engine's "
                                               f"limit of {self.options.max_message_bytes:,} (--max-message-bytes)",
                        protocol.salvage_rid(body[0]))
            return
        try:
            msg = protocol.decode_client(body[0])
        except protocol.DecodeError as e:
            rid, bad_params = protocol.salvage_rid(body[0]), invalid_params(e)
            if bad_params is not None:  # values that cannot work, rather than a malformed message
                code = "invalid_grammar" if isinstance(e.__cause__, InvalidGrammar) else "invalid_params"
                self._error(identity, code, str(bad_params), rid)
            else:
                self._error(identity, "bad_message", f"not a valid message: {e}", rid)
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
        elif isinstance(msg, protocol.Describe):
            self._send(identity, self._describe(msg))
        elif isinstance(msg, protocol.Ping):
            self._send(identity, self._pong(msg))
        elif isinstance(msg, protocol.Shutdown):
            log.info("shutdown requested by client %s", identity.hex())
            self._send(identity, protocol.ShuttingDown(pid=os.getpid()))
            self.request_stop()
        elif isinstance(msg, protocol.Tokenize):
            self._tokenize(identity, msg)
        elif isinstance(msg, protocol.Detokenize):
            self._detokenize(identity, msg)
        else:
            self._send(identity, self._info())

    def _submit(self, identity: bytes, msg: protocol.Submit) -> None:
        rid = _checked_rid(msg.rid)
        if rid in self.requests:
            raise Refused("duplicate_request", f"request id {rid!r} is already in use; choose another")
        waiting = self.llm.num_waiting + len(self.requests.preparing())
        if waiting >= self.options.max_waiting_requests:
            raise Refused("overloaded", f"the waiting queue is full ({waiting} requests); retry later")
        given = [p for p in (msg.prompt, msg.messages, msg.token_ids) if p is not None]
        if len(given) != 1:
            raise Refused("invalid_request", "give exactly one of prompt (text), messages (chat) or token_ids")
        params = msg.params  # validated as it decoded
        if (msg.tools is not None or msg.chat_template_kwargs is not None) and msg.messages is None:
            raise Refused("invalid_request", "tools and chat_template_kwargs go with chat messages")
        try:
            check_template_kwargs(msg.chat_template_kwargs)
        except ValueError as e:
            raise Refused("invalid_request", str(e)) from e
        if msg.tools is not None and self.llm.tool_format is None:
            raise Refused("invalid_request", "this model's chat template has no tool calling; send no tools")
        if msg.client is not None and not 0 < len(msg.client) <= protocol.MAX_CLIENT_LABEL:
            raise Refused("invalid_request", f"client must be a label of 1 to {protocol.MAX_CLIENT_LABEL} characters")
        record = Record(rid, identity, msg.client or self._client_label(identity), params, time.monotonic())
        if msg.token_ids is not None and params.structured is None:
            self._queue(record, msg.token_ids)
        else:  # a text prompt or a grammar: prepared off the loop, after size checks that cost nothing
            # one client's prompts must not starve everyone else's: a client is a connection and the label its
            # requests carry, so each caller of the HTTP front (its address and endpoint) has its own share
            queued = sum((r.owner, r.client) == (identity, record.client) for r, _ in self.requests.preparing())
            if queued >= MAX_PREPARING_PER_CLIENT:
                raise Refused("overloaded", f"{record.client!r} already has {queued} requests being tokenized or "
                                            f"compiled (at most {MAX_PREPARING_PER_CLIENT}); retry when they are done")
            ids: Future[list[int]] = Future()
            if msg.token_ids is not None:
                ids.set_result(msg.token_ids)
            else:
                ids = self._tokenizer.submit(self.llm.encode_prompt, self._text_prompt(msg), msg.tools,
                                             msg.chat_template_kwargs)
            grammar = None if params.structured is None else GrammarJob(self.llm, params.structured, self._grammars)
            record.preparation = Preparation(ids, grammar)
        self.requests.add(record)
        self.stats.submitted += 1
        self.publisher.changed()

    def _preparing_rows(self) -> list[WaitingEntry]:
        """The requests not queued yet, as the snapshot's first waiting rows (their reason: what they wait for)."""
        now = time.monotonic()
        return [WaitingEntry(rid=r.rid, prompt_tokens=prep.prompt_tokens, waited=now - r.arrival, reason=prep.stage,
                             client=r.client, priority=r.params.priority)
                for r, prep in self.requests.preparing()]

    def _text_prompt(self, msg: protocol.Submit) -> str | list[dict]:
        """The prompt or chat of a Submit, once size checks that cost nothing let it through."""
        messages = msg.messages or []
        if len(messages) > self.llm.max_seq_len // 2:  # a chat template spends two tokens on a turn at least
            raise Refused("prompt_too_long", f"the chat has {len(messages)} messages; at most "
                                             f"{self.llm.max_seq_len // 2} fit the context")
        chars = len(msg.prompt) if msg.prompt is not None else sum(len(m.content) for m in messages)
        if chars > self._max_prompt_chars:
            raise Refused("prompt_too_long", f"the prompt has {chars} characters, more than the "
                                             f"{self.llm.max_seq_len - 1} tokens that fit could spell")
        return msg.prompt if msg.prompt is not None else [msgspec.to_builtins(m) for m in messages]

    def _client_label(self, identity: bytes) -> str:
        """A label for a connection that sent none: "client N", numbered in order of first request (an
        operator reads "client 3", not its random routing id; the last REMEMBERED_CLIENTS keep theirs)."""
        number = self._client_numbers.pop(identity, None)
        if number is None:
            self._clients_seen += 1
            number = self._clients_seen
        self._client_numbers[identity] = number
        if len(self._client_numbers) > REMEMBERED_CLIENTS:
            del self._client_numbers[next(iter(self._client_numbers))]
        return f"client {number}"

    def _queue(self, record: Record, ids: list[int], grammar: CompiledGrammar | None = None) -> None:
        """Hand a request to the engine (its timings count the time spent tokenizing and compiling)."""
        try:
            self.llm.add_request(ids, record.params, record.rid, arrival_time=record.arrival, client=record.client,
                                 grammar=grammar)
        except PromptTooLong as e:
            raise Refused("prompt_too_long", str(e)) from e
        except ValueError as e:
            raise Refused("invalid_request", str(e)) from e

    def _admit_prepared(self) -> None:
        """Queue the requests whose prompt and grammar are ready, in arrival order among them (a grammar still
        compiling holds back only its own request); refuse a grammar that has compiled for too long."""
        now = time.monotonic()
        limit = self.options.grammar_time_limit
        for record, prep in self.requests.preparing():
            if prep.grammar is not None and prep.grammar.overdue(now, limit):
                self._refuse_prepared(record, "invalid_grammar", f"structured: the grammar did not compile within "
                                                                 f"{limit:g} s (this engine's --grammar-time-limit); "
                                                                 "simplify it")
            elif prep.ready():
                self._queue_prepared(record, prep)

    def _queue_prepared(self, record: Record, prep: Preparation) -> None:
        """Queue a request whose preparation is done, or tell its client why it cannot be."""
        try:
            grammar = None if prep.grammar is None else prep.grammar.compiled.result()
        except ValueError as e:  # InvalidParams: the grammar does not compile
            self._refuse_prepared(record, "invalid_grammar", str(e))
            return
        except Exception as e:
            log.exception("internal error compiling the grammar of request %s", record.rid)
            self._refuse_prepared(record, "internal", f"{type(e).__name__}: {e}")
            return
        try:
            self._queue(record, prep.ids.result(), grammar)
        except ValueError as e:  # from the tokenizer worker: ids outside the vocabulary, a chat the template refuses
            self._refuse_prepared(record, "invalid_request", str(e))
        except Refused as e:
            self._refuse_prepared(record, e.code, str(e))
        except Exception as e:
            log.exception("internal error tokenizing request %s", record.rid)
            self._refuse_prepared(record, "internal", f"{type(e).__name__}: {e}")
        else:
            self.requests.queued(record)

    def _refuse_prepared(self, record: Record, code: str, message: str) -> None:
        self.requests.remove(record.rid)
        assert record.owner is not None  # a client's requests still preparing go with it (_drop_client)
        self._error(record.owner, code, message, record.rid)

    def _tokenize(self, identity: bytes, msg: protocol.Tokenize) -> None:
        """Token ids as a Submit of the same prompt gets them (the same code on the same worker thread)."""
        self._need_tokenizer()
        if (msg.prompt is None) == (msg.messages is None):
            raise Refused("invalid_request", "give exactly one of prompt (text) or messages (chat)")
        if not (msg.prompt or msg.messages):
            raise Refused("invalid_request", "nothing to tokenize: the prompt is empty")
        rid, prompt, messages = msg.rid, msg.prompt, [msgspec.to_builtins(m) for m in msg.messages or ()]

        def work() -> protocol.Tokens:
            if prompt is not None:
                return protocol.Tokens(rid=rid, token_ids=self.llm.encode_prompt(prompt))
            ids = apply_chat_template(self.llm.tokenizer, template_messages(messages), msg.add_generation_prompt,
                                      tools=msg.tools, template_kwargs=msg.chat_template_kwargs)
            return protocol.Tokens(rid=rid, token_ids=ids)

        self._answer_later(identity, rid, work)

    def _detokenize(self, identity: bytes, msg: protocol.Detokenize) -> None:
        tokenizer = self._need_tokenizer()
        if not msg.token_ids:
            raise Refused("invalid_request", "nothing to detokenize: token_ids is empty")
        rid, ids = msg.rid, msg.token_ids

        def work() -> protocol.Text:  # encode_prompt checks the ids against the vocabulary, as for a Submit
            text = tokenizer.decode(self.llm.encode_prompt(ids))  # a str for one sequence (typed for batches too)
            return protocol.Text(rid=rid, text=cast("str", text))

        self._answer_later(identity, rid, work)

    def _need_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.llm.tokenizer is None:
            raise Refused("invalid_request", "this checkpoint has no tokenizer files, so it cannot (de)tokenize")
        return self.llm.tokenizer

    def _answer_later(self, identity: bytes, rid: str, work: Callable[[], msgspec.Struct]) -> None:
        """Run `work` on the tokenizer worker; `_answer` sends its reply (or its ValueError) when done."""
        _checked_rid(rid)
        if len(self.answering) >= self.options.max_waiting_requests:
            raise Refused("overloaded", f"{len(self.answering)} tokenize calls are queued already; retry later")
        self.answering.append(_Answer(identity, rid, self._tokenizer.submit(work)))

    def _answer(self) -> None:
        """Send the replies of the tokenize / detokenize calls that are done."""
        while self.answering and self.answering[0].reply.done():
            job = self.answering.popleft()
            try:
                reply = job.reply.result()
            except ValueError as e:  # ids out of the vocabulary, messages the chat template refuses
                self._error(job.identity, "invalid_request", str(e), job.rid)
            except Exception as e:
                log.exception("internal error answering %s", job.rid)
                self._error(job.identity, "internal", f"{type(e).__name__}: {e}", job.rid)
            else:
                self._send(job.identity, reply)

    def _abort(self, identity: bytes, rid: str) -> None:
        try:
            self._abort_request(rid)
        except ValueError as e:
            # Answered, but not counted among the errors: an operator's abort can cross the request's own
            # end, and that race is nobody's mistake.
            self._error(identity, "unknown_request", str(e), rid, count=False)
            return
        self._send(identity, protocol.Aborted(rid=rid))

    def _describe(self, msg: protocol.Describe) -> protocol.Description:
        """One request as an operator sees it; "gone" when it is not live (no error: it may have ended
        a moment ago)."""
        record = self.requests.get(msg.rid)
        if record is not None and record.preparation is not None:
            return protocol.Description(rid=msg.rid, state=record.preparation.stage, prompt_head="", prompt_tail="",
                                        client=record.client, params=record.params,
                                        age=time.monotonic() - record.arrival)
        d = self.llm.describe(msg.rid, msg.text_from)
        if d is None:
            return protocol.Description(rid=msg.rid[:MAX_ECHOED_RID], state="gone", prompt_head="", prompt_tail="")
        head, tail = self._text(d.prompt_head), self._text(d.prompt_tail)
        # under the rid asked for: a choice's own ("r#1") is answered under it, not under its request's
        return protocol.Description(**msgspec.structs.asdict(d) | {"rid": msg.rid, "prompt_head": head,
                                                                      "prompt_tail": tail})

    def _text(self, ids: tuple[int, ...]) -> str:
        """The text of a few prompt tokens (special tokens included: a chat template's are part of the
        prompt), or the ids themselves for a checkpoint without a tokenizer."""
        if not ids:
            return ""
        if self.llm.tokenizer is None:
            return " ".join(map(str, ids))
        return cast("str", self.llm.tokenizer.decode(list(ids)))

    def _abort_request(self, rid: str) -> None:
        """Abort now: the scheduler counts it at once and frees the slot and pages as soon as no step in
        flight uses them (at once, or after the step running now); the Final goes out after the next step.
        A request still being tokenized or compiled holds nothing: its Final goes out at once."""
        record = self.requests.get(rid)
        if record is not None and record.preparation is not None:
            self._abort_unqueued(record)
            assert record.owner is not None  # a client's requests still preparing go with it (_drop_client)
            self._send(record.owner, protocol.Outputs(items=[_final_unstarted(rid, record.arrival)]))
        else:  # queued: the engine's Final follows, and the record goes with it (_deliver)
            self.llm.abort(rid)
        self.publisher.changed()

    def _abort_unqueued(self, record: Record) -> None:
        """A request aborted before it reached the engine: it holds nothing there, so it just goes."""
        self.requests.remove(record.rid)
        self.stats.unscheduled_aborts += 1

    def _info(self) -> protocol.Info:
        config = self.llm.config.options()
        config.update(max_waiting_requests=self.options.max_waiting_requests,
                      max_message_bytes=self.options.max_message_bytes, allow_remote=self.options.allow_remote)
        return protocol.Info(version=engine.__version__, pid=os.getpid(), host=socket.gethostname(),
                             model=str(self.llm.checkpoint.path), address=self.sockets.address,
                             stats_address=self.sockets.stats_address, max_seq_len=self.llm.max_seq_len,
                             num_pages=self.llm.num_pages, config=config, execution=self.llm.execution,
                             model_info=self.llm.model_info, tool_format=self.llm.tool_format,
                             think_markers=_markers(self.llm.think_markers),
                             generation_defaults=self.llm.generation_defaults, system_role=self.llm.system_role,
                             default_system=self.llm.default_system, chat_template=self.llm.has_chat_template)

    # -- sending ----------------------------------------------------------------------------------
    def _send(self, identity: bytes, msg: msgspec.Struct) -> bool:
        """Send to one client (or hold it while its queue is full, engine/service/outbox.py); if it is gone,
        abort its requests."""
        try:
            self._outbox.send(identity, protocol.encode(msg))
        except ClientGone as e:
            self._drop_client(identity, e.why)
            return False
        self._last_sent[identity] = time.monotonic()
        return True

    def _flush(self) -> None:
        """What clients' full queues held back goes out as they read; one that reads nothing too long is dropped."""
        for identity, why in self._outbox.flush():
            self._drop_client(identity, why)

    def _error(self, identity: bytes, code: str, message: str, rid: str | None = None, count: bool = True) -> None:
        """Reply with an Error; `count` it among the stats' errors unless it is no client's fault."""
        log.info("refused a message: [%s] %s", code, message)
        if count:
            self.stats.errors += 1
            self.publisher.changed()
        if rid is not None and len(rid) > MAX_ECHOED_RID:
            rid = None
        self._send(identity, protocol.Error(code=code, message=message, rid=rid))

    def _drop_client(self, identity: bytes, why: str) -> None:
        """Abort a gone client's requests. One still preparing goes at once; a queued one keeps its record,
        without an owner, until the engine's Final for the abort (dropped): its rid stays taken meanwhile."""
        records = self.requests.of(identity)
        for record in records:
            if record.preparation is not None:
                self._abort_unqueued(record)
            else:
                record.owner = None
                with contextlib.suppress(ValueError):  # it may have finished in the step being delivered
                    self.llm.abort(record.rid)
        if records:
            self.publisher.changed()
        self._last_sent.pop(identity, None)
        self._outbox.forget(identity)
        log.warning("client %s is gone (%s); aborted its %d request(s)", identity.hex(), why, len(records))

    def _deliver(self, result: StepResult) -> None:
        """One `Outputs` message per client, carrying the step's Delta or Final of each of its requests."""
        self.stats.record_step(result)
        self.publisher.changed()
        per_client: dict[bytes, list[Output]] = {}
        for out in result.outputs:
            record = self.requests.get(out.rid)
            if record is None:
                continue
            if out.finished:
                self.requests.remove(out.rid)
            if record.owner is not None:  # else its client is gone
                per_client.setdefault(record.owner, []).append(out)
        for identity, items in per_client.items():
            self._send(identity, protocol.Outputs(items=items))

    def _sweep_clients(self) -> None:
        """Heartbeat clients that have live requests but heard nothing lately; a failed send drops them."""
        now = time.monotonic()
        if now - self._last_sweep < HEARTBEAT_INTERVAL:
            return
        self._last_sweep = now
        live = self.requests.owners()
        self._last_sent = {i: t for i, t in self._last_sent.items() if i in live}
        for identity in live:
            if now - self._last_sent.get(identity, 0.0) >= HEARTBEAT_INTERVAL:
                self._send(identity, protocol.Heartbeat())

    # -- shutdown ---------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Abort everything in flight, tell each owner with a Final, publish a last snapshot."""
        rids = [record.rid for record in self.requests]
        for rid in rids:
            with contextlib.suppress(ValueError):  # a gone client's request is aborted already
                self._abort_request(rid)
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
        self._grammars.shutdown(wait=False, cancel_futures=True)
        while self.llm.has_unfinished():
            self._deliver(self._step())
        self._flush()  # the Finals of clients that are behind: what their queues take now
        self.publisher.publish(idle=True, force=True)
        log.info("engine stopping: aborted %d in-flight request(s)", len(rids))


def _markers(markers: ThinkMarkers | None) -> list[str] | None:
    return None if markers is None else [markers.start, markers.end]


def _checked_rid(rid: str) -> str:
    if not rid or len(rid) > MAX_RID_LEN:
        raise Refused("invalid_request", f"rid must be a non-empty string of at most {MAX_RID_LEN} characters")
    return rid


def _final_unstarted(rid: str, arrival: float) -> Final:
    """The Final of a request aborted before it reached the scheduler."""
    return Final(rid=rid, text="", token_ids=[], finish_reason="abort",
                 usage=Usage(prompt_tokens=0, completion_tokens=0, cached_tokens=0),
                 timings=Timings(queue=None, ttft=None, total=time.monotonic() - arrival))


def load_llm(config: EngineConfig) -> LLM:
    """The LLM for `config`, with a clear error when the embedded demo model has not been built."""
    if config.model is None and not (DEMO_MODEL_DIR / "config.json").is_file():
        raise ValueError(f"no --model given, and the embedded demo model is not built yet ({DEMO_MODEL_DIR}); "
                         f"pass --model PATH (an HF checkpoint directory) or build it with "
                         f"scripts/train_demo_model.py")
    return LLM(**config.options())


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
        freeze_loaded()
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


def _yield_cores() -> None:
    """Run the grammar worker (and the threads xgrammar starts from it, which inherit this) at the lowest
    priority: a compile beside the step's OpenMP team took a core from it, and every barrier of a step then
    waited for a descheduled team member (a 1 s token gap, measured, where the steps take 10 ms)."""
    with contextlib.suppress(OSError):  # not Linux's per-thread niceness: the compile competes, that is all
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
