"""The wire protocol between clients and the engine process: msgspec Structs encoded as MessagePack.

Every message is a MessagePack map with a "type" field naming its kind (a tagged union), so a
client in any language can speak it; docs/protocol.md is the reference. Nothing here imports torch,
so clients stay light. Incoming messages are validated against these schemas (unknown fields are
refused, to catch typos); anything that does not decode gets an `Error` reply. The engine's own types
are the wire's where they meet: a Submit carries `engine.SamplingParams` (validated as it decodes), and
an `Outputs` message the engine's `Delta` and `Final` (engine/outputs.py) as the scheduler made them,
the stats the KV page map's `PageRun`s (engine/pages.py) and the scheduler snapshot's rows, and a
`Description` the scheduler's `RequestDetail` (both engine/scheduler/snapshot.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.outputs import Delta, Final
from engine.pages import PageRun, TierUse
from engine.params import SamplingParams
from engine.scheduler.snapshot import RequestDetail, RunningEntry, WaitingEntry


class _ClientMsg(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    """Client -> engine. Strict: a misspelled field is an error, not silently ignored."""


class _EngineMsg(msgspec.Struct, tag_field="type", kw_only=True):
    """Engine -> client. Lenient, so older clients tolerate fields added later."""


# -- client -> engine ---------------------------------------------------------------------------
MAX_CLIENT_LABEL = 128  # characters of a Submit's `client` label


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One chat turn; `tool_calls` on an assistant turn that called tools, `tool_call_id` (and `name`)
    on the "tool" turn answering one; `reasoning_content` an assistant turn's thinking, for templates
    that render it (Qwen3's)."""

    role: str
    content: str  # "" for an assistant turn that only called tools
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class Submit(_ClientMsg, tag="submit"):
    """Start a request. Give exactly one of `prompt` (text), `messages` (chat) or `token_ids`.

    `rid` is chosen by the client and must be unique among the engine's live requests. `client` is a
    short label of who sends it ("bench", "console tab 3", "http POST /v1/completions"), shown to
    operators in the stats and `Description`; without one the engine labels it by connection.
    `tools` and `chat_template_kwargs` (more variables for the template: `enable_thinking`) go with
    `messages`.
    """

    rid: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, rendered by the chat template
    client: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class Abort(_ClientMsg, tag="abort"):
    """Abort a live request, whoever submitted it (the engine is an ops console)."""

    rid: str


class Describe(_ClientMsg, tag="describe"):
    """Ask about one request, whoever submitted it: answered by `Description` (never by an error: a
    request that is not live is described as "gone"). `text_from` is how many characters of its
    output the asker has already, so polling a long output sends only what is new."""

    rid: str
    text_from: int = 0


class Ping(_ClientMsg, tag="ping"):
    """Liveness and readiness check; answered by `Pong` with the same nonce."""

    nonce: int = 0


class GetInfo(_ClientMsg, tag="get_info"):
    """Ask for the engine's model, configuration and version; answered by `Info`."""


class Shutdown(_ClientMsg, tag="shutdown"):
    """Stop the engine (what `minichat stop` sends): answered by `ShuttingDown`, then every in-flight
    request ends with a `Final` ("abort") and the engine exits, as on SIGTERM."""


class Tokenize(_ClientMsg, tag="tokenize"):
    """Token ids of a prompt as a `Submit` of it would get them: text (with the tokenizer's special
    tokens) or chat messages through the model's chat template. Answered by `Tokens` with the same `rid`,
    which only pairs the reply with its call: it is no request, and may repeat a live request's id."""

    rid: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # chat only: end with the assistant turn's opening, as a Submit does
    tools: list[dict[str, Any]] | None = None  # chat only, as a Submit's
    chat_template_kwargs: dict[str, Any] | None = None  # chat only, as a Submit's


class Detokenize(_ClientMsg, tag="detokenize"):
    """The text of token ids (special tokens included); answered by `Text` with the same `rid`."""

    rid: str
    token_ids: list[int]


ClientMessage = Submit | Abort | Describe | Ping | GetInfo | Shutdown | Tokenize | Detokenize


# -- engine -> client ---------------------------------------------------------------------------
class Outputs(_EngineMsg, tag="outputs"):
    """What one engine step produced for this client: a `Delta` or the `Final` of each of its requests
    that advanced, in step order. One message per client per step, however many requests it runs;
    across messages each request's items arrive in order, and nothing follows its Final."""

    items: list[Delta | Final]


class Error(_EngineMsg, tag="error"):
    """A refused or malformed message. `rid` names the request it concerns, when known.

    Codes: bad_message, invalid_request, invalid_params, prompt_too_long (the prompt alone exceeds the
    context: shorten it), too_large (the message exceeds the engine's max_message_bytes),
    duplicate_request, unknown_request, overloaded, internal.
    """

    code: str
    message: str
    rid: str | None = None


class Aborted(_EngineMsg, tag="aborted"):
    """Acknowledges an Abort: the request is gone and its slot and pages are free. Its owner also gets
    a `Final` with finish_reason "abort"."""

    rid: str


class Pong(_EngineMsg, tag="pong"):
    """Answers a Ping. `busy_for` is how long the step in progress has run when one is (the engine answers
    pings during a long step: liveness.py), so a slow engine reads as slow, not as dead."""

    nonce: int
    version: str
    pid: int
    busy_for: float | None = None


class Info(_EngineMsg, tag="info"):
    """What the engine runs: `config` holds every engine option plus the server's limits; `execution`
    what the options resolved to here (`LLM.execution`: `auto` choices and fallbacks); `model_info` what the model
    is (`LLM.model_info`: family, architecture, layers, attention, experts, window)."""

    version: str
    pid: int
    host: str
    model: str
    address: str
    stats_address: str
    max_seq_len: int
    num_pages: int
    config: dict[str, Any]
    execution: dict[str, str] = msgspec.field(default_factory=dict)
    model_info: dict[str, str] = msgspec.field(default_factory=dict)
    tool_format: str | None = None  # how the model writes tool calls (engine/tools.py); None: it does not
    think_markers: list[str] | None = None  # its think block's start and end (engine/reasoning.py); None: none
    # the sampling settings the checkpoint recommends (its generation_config.json: engine/generation_defaults.py),
    # which clients may start from; empty when it names none
    generation_defaults: dict[str, float | int] = msgspec.field(default_factory=dict)
    system_role: bool = True  # whether the chat template renders a system message (some refuse or drop one)
    default_system: str = ""  # the system message the chat template adds to a chat without one ("": none)
    chat_template: bool = True  # whether the model has a chat template (a base model: none; send it plain prompts)


class ShuttingDown(_EngineMsg, tag="shutting_down"):
    """Acknowledges a `Shutdown`: the engine (process `pid`) is stopping."""

    pid: int


class Heartbeat(_EngineMsg, tag="heartbeat"):
    """Sent about once a second to clients with live requests that got nothing else: it proves the
    client is still connected (a failed send aborts its requests) and the engine still alive."""


class Tokens(_EngineMsg, tag="tokens"):
    """Answers `Tokenize`: the prompt's token ids (their count is what a Submit's usage would report)."""

    rid: str
    token_ids: list[int]


class Text(_EngineMsg, tag="text"):
    """Answers `Detokenize`."""

    rid: str
    text: str


class Description(_EngineMsg, RequestDetail[str], tag="description"):
    """Answers `Describe`: one request as an operator wants to see it, the scheduler's `RequestDetail`
    with the prompt's ends as text (special tokens included). `state` is the scheduler's ("waiting",
    "prefilling", "running"), or the server's: "tokenizing" (its text prompt is being tokenized),
    "compiling grammar" (its grammar is, off the engine's loop), or "gone" (finished, aborted, or never
    known; every other field is then empty)."""


EngineMessage = (Outputs | Error | Aborted | Pong | Info | ShuttingDown | Heartbeat | Tokens | Text
                 | Description)


# -- stats (PUB socket) -------------------------------------------------------------------------
class Pages(msgspec.Struct, kw_only=True):
    """The KV pool: how many pages are free, held by a request, cached, or cached and locked (a running
    request reads it), and where they are as runs (engine/pages.py: `paint` turns them into a state per
    page), laid in order, a later run over an earlier one. When `base` is the seq of the Stats carrying
    them they paint every page; otherwise they are only the pages changed since the Stats numbered
    `base`, whose runs did: lay these over those. The engine sends a complete list to a new subscriber,
    at least every 5 s, and whenever it is cheaper than the changes; minichat's clients keep the newest
    (StatsFeed), so every Stats they return paints every page."""

    page_size: int
    free: int
    held: int
    cached: int
    locked: int
    total: int
    claimed: int = 0  # further pages admission counts the admitted requests for (it admits no one into them)
    base: int = 0
    runs: list[PageRun] = msgspec.field(default_factory=list)
    owners: list[str] = msgspec.field(default_factory=list)  # the requests holding pages: PageRun.owner indexes this
    tiers: list[TierUse] = msgspec.field(default_factory=list)  # the tiers below the pool: host memory, disk
    dtype: str = ""  # what the pages hold (--kv-cache-dtype): "int8" or a float dtype's name
    page_bytes: int = 0  # one page's bytes, every layer's K and V

    @property
    def used(self) -> int:
        """Pages running requests use: held, or cached and locked (what vLLM's KV usage counts)."""
        return self.held + self.locked

    @property
    def usage(self) -> float:
        """`used` as a share of the pool, as `vllm:kv_cache_usage_perc` reports it."""
        return self.used / max(self.total, 1)


class Counters(msgspec.Struct, kw_only=True):
    """Totals since start, and rates over the last couple of seconds."""

    submitted: int
    finished: int
    aborted: int
    errors: int
    steps: int
    prefill_tokens: int
    decode_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    steps_per_s: float
    retractions: int = 0  # running requests sent back to the waiting queue because the KV pool ran dry
    # speculative decoding: verifications of drafts, drafts proposed and accepted (totals), and their rates
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_tokens_per_s: float = 0.0
    spec_accepted_tokens_per_s: float = 0.0
    # prompt tokens first admissions found cached: in the KV pool, loaded from host memory, loaded from disk
    hit_tokens_pool: int = 0
    hit_tokens_host: int = 0
    hit_tokens_disk: int = 0

    @property
    def spec_acceptance(self) -> float:
        """The share of draft tokens accepted since start (0 before any)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verification emitted on average (its accepted drafts and the target's token; 0 before any)."""
        return 1.0 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else 0.0


class StepRecord(msgspec.Struct, kw_only=True):
    """One scheduler step: `at` is seconds since engine start, `duration` in seconds."""

    index: int
    kind: str
    rids: list[str]
    num_tokens: int
    duration: float
    at: float


class Stats(_EngineMsg, tag="stats"):
    """A complete snapshot, so a subscriber that joins late needs nothing else, but for the map of KV pages:
    that may be the changes since an earlier Stats (see Pages)."""

    seq: int
    time: float
    uptime: float
    model: str
    waiting: list[WaitingEntry]  # the requests the server prepares first, then the scheduler's, in admission order
    running: list[RunningEntry]
    slots: list[str | None]
    pages: Pages
    counters: Counters
    steps: list[StepRecord]
    admission: str = ""  # the admission rule and its current estimate
    policy: str = ""  # the waiting queue's order: fcfs, priority or lpm
    # seconds from arrival to first token of the requests whose first token came in the last 10 s (the
    # latest 256), so a dashboard has TTFT percentiles without a histogram
    ttfts: list[float] = msgspec.field(default_factory=list)


# -- codecs -------------------------------------------------------------------------------------
_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)
_stats_decoder = msgspec.msgpack.Decoder(Stats)

DecodeError = msgspec.DecodeError  # ValidationError is a subclass


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_client(data: bytes) -> Submit | Abort | Describe | Ping | GetInfo | Shutdown | Tokenize | Detokenize:
    try:
        return _client_decoder.decode(data)
    except RecursionError:  # an unknown field whose value nests thousands deep
        raise msgspec.DecodeError("the message nests too deeply") from None


def decode_engine(data: bytes) -> EngineMessage:
    return _engine_decoder.decode(data)


def decode_stats(data: bytes) -> Stats:
    return _stats_decoder.decode(data)


def salvage_rid(data: bytes) -> str | None:
    """The `rid` of a message that failed validation, if it has a readable one, so the error reaches
    the request's waiter instead of nobody."""
    try:
        raw = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):  # RecursionError: a hostile, deeply nested frame
        return None
    rid = raw.get("rid") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else None
