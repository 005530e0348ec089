"""Chat sessions as plain data: history, settings and per-reply stats.

Kept apart from the widgets so that a lost engine, a closed panel or a re-rendered tab never loses a
conversation, and so the rules (what history is sent, how a reply's numbers are computed, which settings
are the model's and which a person chose) can be read and tested without a terminal.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.config import model_id
from engine.outputs import Delta, Final
from engine.params import SamplingParams
from engine.service.protocol import Info

CONSOLE_DEFAULTS = SamplingParams(max_tokens=256, temperature=0.8, top_p=0.95, top_k=-1)
"""What a setting is that neither a person chose nor the model recommends (its generation_config.json), beside a
model's recommendations (they are its distribution: nothing of ours is added to cut it)."""
LOCAL_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
"""For a model that recommends nothing: llama.cpp's server defaults, which suit small local models (on SmolLM2-135M's
Q4_1 file, 45 of 100 sampled answers to five plain questions named the right thing, against 36 at temp 0.8 and
top-p 0.95 alone, 43 at Ollama's defaults and 60 greedy; docs/console.md)."""
LOCAL_ORIGIN = "llama.cpp defaults"
TITLE_WIDTH = 30  # characters of an automatic title
MIN_RATE_TOKENS = 8
"""Decode tokens (after the first) a reply needs before its rate is shown: a rate over fewer is a few steps'
timing noise (a 5-token reply read "2443.7 tok/s" when the console timed tokens that arrived together)."""


def _flag(text: str) -> bool:
    if text.lower() in ("on", "true", "yes", "1"):
        return True
    if text.lower() in ("off", "false", "no", "0"):
        return False
    raise ValueError(text)


# The settings a person may change per session: name -> (parse, what is allowed, the settings line's phrase).
# The range itself is SamplingParams' to check, as the engine checks it.
SETTINGS: dict[str, tuple[Callable[[str], Any], str, Callable[[Any], str]]] = {
    "temperature": (float, "a number, 0 or more (0 = greedy)", lambda v: f"temp {v:g}"),
    "top_p": (float, "a number in (0, 1]", lambda v: f"top-p {v:g}"),
    "top_k": (int, "-1 (off) or an integer of at least 1", lambda v: f"top-k {'off' if v == -1 else v}"),
    "min_p": (float, "a number in [0, 1] (0 = off)", lambda v: f"min-p {v:g}"),
    "repetition_penalty": (float, "a number in (0, 100] (1 = off)", lambda v: f"repetition penalty {v:g}"),
    "max_tokens": (int, "an integer of at least 1", lambda v: f"max {v} tok"),
    "ignore_eos": (_flag, "on or off", lambda v: "ignore EOS"),
    "priority": (int, "an integer (lower runs first under --schedule-policy priority; default 0)",
                 lambda v: f"priority {v}"),
}
ALWAYS_SHOWN = ("temperature", "top_p", "top_k", "max_tokens")  # the others only when they do something


def parse_setting(name: str, text: str) -> Any:
    """The value of setting `name` written as `text`; ValueError naming the allowed range otherwise."""
    parse, allowed, _ = SETTINGS[name]
    try:
        value = parse(text.strip())
    except ValueError:
        raise ValueError(f"{name} must be {allowed}; got {text.strip()!r}") from None
    SamplingParams(**{name: value})  # InvalidParams (a ValueError) in the engine's words
    return value


@dataclass(frozen=True)
class EngineModel:
    """The model a session's engine runs, as its `info` says: its name and context, the sampling settings it
    recommends (generation_config.json; engine/generation_defaults.py), whether its chat template takes a
    system message, and the one it adds to a chat without one ("": none)."""

    name: str
    context: int
    defaults: dict[str, Any] = field(default_factory=dict)
    system_role: bool = True
    default_system: str = ""
    chat: bool = True  # a chat template; False: a base model, whose conversation goes as one plain text

    @classmethod
    def of(cls, info: Info) -> EngineModel:
        return cls(model_id(info.model), info.max_seq_len, dict(info.generation_defaults), info.system_role,
                   info.default_system, info.chat_template)


@dataclass
class Reply:
    """One assistant reply as it streams in. `state` moves queued -> streaming -> one of done, aborted,
    error or interrupted (the engine went away); the text that arrived is always kept.

    Two clocks, shown apart because they answer different questions: `ttft` and `total` are the
    person's, from the moment the message was sent (`started`) to its first token and to its end;
    `queue` and `engine_ttft` are the engine's own (the Final's timings, from when the engine received
    the request): how long it waited for admission, until its first token (so prefill is the difference) and
    until its last (so decoding is the difference again). A slow console or a busy link shows in the first
    and not in the second."""

    rid: str
    text: str = ""
    reasoning: str = ""  # the model's thinking, split off the text by the engine (not sent back, not saved)
    reasoning_tokens: int = 0  # counted as it streams, the engine's own count once the Final is in
    state: str = "queued"
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    ttft: float | None = None
    total: float | None = None
    max_tokens: int | None = None  # what was asked for: a shorter `length` finish means the context ran out
    queue: float | None = None
    engine_ttft: float | None = None
    engine_total: float | None = None
    cached_tokens: int | None = None  # of the prompt's, served from the engine's prefix cache
    draft_tokens: int = 0  # speculative drafts the engine verified for it (0: it does not speculate)
    accepted_tokens: int = 0  # of them accepted (part of completion_tokens)
    started: float = field(default_factory=time.monotonic)

    @property
    def live(self) -> bool:
        return self.state in ("queued", "streaming")

    def add(self, out: Delta | Final) -> None:
        """Fold one streamed message in; a Final brings the engine's own token counts and timings."""
        now = time.monotonic()
        if out.token_ids and self.ttft is None:
            self.ttft = now - self.started
        self.text += out.text
        self.reasoning += out.reasoning
        self.reasoning_tokens += len(out.token_ids) if out.reasoning else 0
        self.completion_tokens += len(out.token_ids)
        self.state = "streaming"
        if isinstance(out, Final):
            self.reasoning_tokens = out.usage.reasoning_tokens
            self.finish_reason = out.finish_reason
            self.state = "aborted" if out.finish_reason == "abort" else "done"
            self.prompt_tokens, self.cached_tokens = out.usage.prompt_tokens, out.usage.cached_tokens
            self.completion_tokens = out.usage.completion_tokens
            self.draft_tokens, self.accepted_tokens = out.usage.draft_tokens, out.usage.accepted_tokens
            self.queue, self.engine_ttft, self.engine_total = out.timings.queue, out.timings.ttft, out.timings.total
            self.total = now - self.started

    def fail(self, state: str, why: str) -> None:
        """End without a Final: `error` (refused) or `interrupted` (engine lost); the text stays."""
        self.state, self.error, self.total = state, why, time.monotonic() - self.started

    @property
    def context_full(self) -> bool:
        """Cut short because prompt and reply reached the model's context, not at the asked max_tokens."""
        return self.finish_reason == "length" and self.max_tokens is not None and \
            self.completion_tokens < self.max_tokens

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second over the decode phase alone (from the first token to the last, on the engine's
        clock, so neither the queue, the prefill nor the link's batching counts); None before the Final and
        for a reply too short to time (MIN_RATE_TOKENS)."""
        if self.engine_ttft is None or self.engine_total is None:
            return None
        tokens, seconds = self.completion_tokens - 1, self.engine_total - self.engine_ttft
        return tokens / seconds if tokens >= MIN_RATE_TOKENS and seconds > 0 else None

    def engine_split(self) -> str | None:
        """The engine's side of the wait, e.g. `engine: 1.70 s queued + 0.10 s prefill` (None before the Final)."""
        if self.engine_ttft is None:
            return None
        if self.queue is None:
            return f"engine: first token {self.engine_ttft:.2f} s"
        return f"engine: {self.queue:.2f} s queued + {self.engine_ttft - self.queue:.2f} s prefill"

    def footer(self) -> list[str]:
        """The numbers under the reply, a phrase per field of FOOTER that has something to say."""
        return [phrase for show in FOOTER if (phrase := show(self))]

    def summary(self) -> str:
        """The footer on one line, e.g. `12 → 40 tok · 8 prompt tok from cache · first token in 1.84 s (engine:
        1.70 s queued + 0.10 s prefill) · decode 31.5 tok/s · stop`."""
        return " · ".join(self.footer())


def _token_counts(reply: Reply) -> str:
    prompt = "" if reply.prompt_tokens is None else f"{reply.prompt_tokens} → "
    return f"{prompt}{reply.completion_tokens} tok"


def _cached(reply: Reply) -> str | None:
    return f"{reply.cached_tokens} prompt tok from cache" if reply.cached_tokens else None


def _first_token(reply: Reply) -> str | None:
    if reply.ttft is None:
        return None
    split = reply.engine_split()
    return f"first token in {reply.ttft:.2f} s" + (f" ({split})" if split else "")


def _thinking(reply: Reply) -> str | None:
    return f"{reply.reasoning_tokens} thinking" if reply.reasoning_tokens else None


def _drafts(reply: Reply) -> str | None:
    return f"{reply.accepted_tokens} of {reply.draft_tokens} drafts accepted" if reply.draft_tokens else None


def _decode_rate(reply: Reply) -> str | None:
    return f"decode {rate:.1f} tok/s" if (rate := reply.decode_rate) is not None else None


def _ending(reply: Reply) -> str | None:
    if reply.state == "done" and reply.context_full:
        return "length: the model's context is full (/clear starts afresh)"
    if reply.state == "done":
        return reply.finish_reason or "done"
    if reply.state in ("aborted", "error", "interrupted"):
        return reply.state + (f": {reply.error}" if reply.error else "")
    return None


FOOTER: tuple[Callable[[Reply], str | None], ...] = (_token_counts, _thinking, _cached, _first_token, _decode_rate,
                                                     _drafts, _ending)
"""The reply footer's fields, in order: each reads the Reply (which took its numbers from the Final) and says
something or nothing (a reply without thinking, or from an engine that does not speculate, shows neither). A
number the engine comes to report is one more field here and one more Reply field (saved with it:
tui/store.py's REPLY_FIELDS)."""


def encodable(text: str) -> str:
    """`text` as any encoding can carry it: UTF-16 surrogate halves that pair (a paste from some terminals) are
    joined into their character, a lone half (which no encoding can write: SQLite refuses it) becomes U+FFFD,
    visibly, where the text enters rather than failing every later save of it."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text


def title_from(prompt: str, width: int = TITLE_WIDTH) -> str:
    """A conversation's automatic title: its first message's first line, cut at a word within `width`."""
    line = " ".join((prompt.strip().splitlines() or [""])[0].split())
    if len(line) <= width:
        return line or "chat"
    head = line[: width - 1]
    if line[width - 1] != " " and " " in head:  # the cut falls inside a word: leave that word out
        head = head.rsplit(" ", 1)[0]
    return head.rstrip() + "…"


@dataclass
class Turn:
    prompt: str
    reply: Reply


@dataclass
class Session:
    """A conversation with its own system prompt and sampling settings.

    A setting is the person's where they chose one (`chosen`, /temperature 0.7), else the recommendation of
    the model its engine runs (`engine`, from the engine's info), else the console's (CONSOLE_DEFAULTS);
    /reset forgets the person's. `model` and `context` are the model its replies came from and that model's
    context, kept with the conversation, so that reopened under another model it can say so.
    Turns before `context_start` stay on screen and in the store but are no longer sent: the oldest
    turns are dropped when the history outgrows the model's context, and `/clear` drops them all.
    `titled`: the name is a person's or already the automatic title, not the console's `chat N`.
    `group`: the fan-out this session belongs to; such a session is scratch, never saved, until kept.
    """

    name: str
    system_prompt: str = ""
    chosen: dict[str, Any] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    context_start: int = 0
    titled: bool = False
    group: str | None = None
    thinking: bool | None = None  # `/think on|off`: enable_thinking for the chat template; None: its default
    model: str | None = None
    context: int | None = None
    engine: EngineModel | None = None  # not kept: the engine it talks to now tells it again

    @property
    def model_defaults(self) -> dict[str, Any]:
        """The settings the engine's model recommends (none before an engine has said)."""
        return self.engine.defaults if self.engine is not None else {}

    @property
    def console_defaults(self) -> dict[str, Any]:
        """The console's settings under the person's: llama.cpp's for a model that recommends none (once an engine
        has said so), none beside a model's own."""
        return LOCAL_DEFAULTS if self.engine is not None and not self.model_defaults else {}

    @property
    def params(self) -> SamplingParams:
        """What the next request is sent with: the person's settings over the model's over the console's."""
        return msgspec.structs.replace(CONSOLE_DEFAULTS, **{**self.console_defaults, **self.model_defaults,
                                                            **self.chosen})

    def follow(self, engine: EngineModel) -> None:
        """The engine this session talks to runs `engine`: its defaults and chat template apply from now on."""
        self.engine = engine

    def answered_by_engine(self) -> None:
        """A reply is being asked of the engine's model: the conversation is now one with it."""
        if self.engine is not None:
            self.model, self.context = self.engine.name, self.engine.context

    def other_model(self) -> str | None:
        """What to say when the conversation was had with another model (or context) than its engine's now."""
        now, then = self.engine, (self.model, self.context)
        if now is None or self.model is None or then == (now.name, now.context):
            return None
        had = self.model + (f" (context {self.context})" if self.context else "")
        return (f"this conversation was with {had}; the engine now runs {now.name} (context {now.context}), "
                f"which gives the replies from here on")

    @property
    def live(self) -> Reply | None:
        """The reply still generating, if any (a session runs one request at a time)."""
        return self.turns[-1].reply if self.turns and self.turns[-1].reply.live else None

    def messages(self, prompt: str | None, start: int | None = None) -> list[dict[str, str]]:
        """The history from turn `start` (default: what is still in context) plus `prompt` (None: the history
        alone), for the engine to render with the chat template.

        Turns whose reply has no text are left out, so user and assistant messages alternate (some
        templates refuse anything else); an aborted reply's partial text counts as said. Where the chat
        template has no system role (it refuses one, or drops it), the system prompt goes as the first
        message's opening paragraph, the one place such a template leaves for it.
        """
        system = self.system_prompt if self.takes_system else ""
        msgs = [{"role": "system", "content": system}] if system else []
        for turn in self.turns[self.context_start if start is None else start:]:
            if turn.reply.text:
                msgs += [{"role": "user", "content": turn.prompt}, {"role": "assistant", "content": turn.reply.text}]
        if prompt is not None:
            msgs.append({"role": "user", "content": prompt})
        if self.system_prompt and not system and msgs:  # a template without a system role: it opens the first message
            msgs[0] = {"role": "user", "content": f"{self.system_prompt}\n\n{msgs[0]['content']}"}
        return msgs

    def request(self, prompt: str | None, start: int | None = None) -> str | list[dict[str, str]]:
        """What the engine is sent: the chat's messages (`messages`), or for a model without a chat template (a
        base model) the conversation as one text it continues (`transcript`)."""
        return self.messages(prompt, start) if self.chat else self.transcript(prompt, start)

    def transcript(self, prompt: str | None, start: int | None = None) -> str:
        """The conversation as a base model continues it: the system prompt, then each message with the model's
        continuation of it, each message on a new line (as in llama.cpp's completion)."""
        parts = [self.system_prompt] if self.system_prompt else []
        for turn in self.turns[self.context_start if start is None else start:]:
            if turn.reply.text:
                parts.append(turn.prompt + turn.reply.text)
        if prompt is not None:
            parts.append(prompt)
        return "\n".join(parts)

    @property
    def chat(self) -> bool:
        """Whether the engine's model has a chat template; true until an engine says otherwise."""
        return self.engine is None or self.engine.chat

    @property
    def takes_system(self) -> bool:
        """Whether the engine's chat template renders a system message (else the system prompt opens the first
        message sent); true until an engine says otherwise."""
        return self.engine is None or self.engine.system_role

    async def fit(self, prompt: str, context: int,
                  count: Callable[[str | list[dict[str, str]]], Awaitable[int]]) -> int:
        """Drop the oldest turns until the history plus `prompt` leaves room for a reply in a
        `context`-token model (the system prompt and the turn being sent always stay); returns how many
        were dropped.

        `count` is the engine's token count of some messages, a tokenize round trip: one for the history
        as it stands, so one per message sent (never per keystroke); when that is too long, a galloping
        then binary search finds the fewest turns to drop, one more call to drop one turn, about
        2·log2(k) to drop k."""
        room = context - min(self.params.max_tokens, context // 4)
        first, last = self.context_start, len(self.turns) - 1

        async def fits(start: int) -> bool:
            return await count(self.request(prompt, start)) <= room

        if first >= last or await fits(first):
            return 0
        too_long, step = first, 1  # too_long: a start known not to fit
        while too_long + step < last and not await fits(too_long + step):
            too_long, step = too_long + step, step * 2
        enough = min(too_long + step, last)  # fits, or is all that can be dropped
        while enough - too_long > 1:
            middle = (too_long + enough) // 2
            too_long, enough = (too_long, middle) if await fits(middle) else (middle, enough)
        self.context_start = enough
        return enough - first

    @property
    def context_used(self) -> int | None:
        """Tokens of the context the last reply filled (its prompt and its own tokens). While a reply streams its
        prompt's count is not known yet (the engine says it at the end): the last known figure plus the tokens
        streamed so far, a lower bound (`context_settled` False)."""
        known = None
        for turn in reversed(self.turns[self.context_start:]):
            if turn.reply.prompt_tokens is not None:
                known = turn.reply.prompt_tokens + turn.reply.completion_tokens
                break
        live = self.live
        if live is None or live.prompt_tokens is not None:
            return known
        return (known or 0) + live.completion_tokens

    @property
    def context_settled(self) -> bool:
        """Whether `context_used` is the engine's count (no reply streaming), not a lower bound."""
        return self.live is None

    def clear(self) -> None:
        """Start afresh: nothing said so far is sent again (it stays on screen and in the store)."""
        self.context_start = len(self.turns)

    def truncate(self, index: int) -> None:
        """Forget turn `index` and those after it (to send it again, edited or regenerated)."""
        del self.turns[index:]
        self.context_start = min(self.context_start, index)

    def auto_title(self) -> bool:
        """Name a session the console named `chat N` after its first exchange, once; True if it did."""
        if self.titled or not self.turns or self.turns[0].reply.live:
            return False
        self.name, self.titled = title_from(self.turns[0].prompt), True
        return True

    def rename(self, name: str) -> None:
        """A name a person gives, kept over the automatic title; an empty one (`/rename` alone) changes nothing."""
        if name:
            self.name, self.titled = name, True

    def start_turn(self, prompt: str) -> Turn:
        """Record a new prompt with an empty reply whose request id names this session."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")[:16] or "chat"
        turn = Turn(prompt, Reply(rid=f"{slug}-{len(self.turns) + 1}-{uuid.uuid4().hex[:6]}",
                                  max_tokens=self.params.max_tokens))
        self.turns.append(turn)
        return turn

    def set(self, name: str, text: str) -> None:
        """Choose one sampling setting from its text form (ValueError if out of range)."""
        self.chosen = {**self.chosen, name: parse_setting(name, text)}

    def reset(self) -> None:
        """Back to the model's recommendations (the console's where it makes none): forget what was chosen."""
        self.chosen = {}

    def settings(self) -> list[str]:
        """The sampling settings as short phrases (wrapped between, never inside): those the model recommends
        and nobody changed as one, e.g. `model default: temp 0.2, top-p 0.9` (or, for a model that recommends
        none, the console's: `llama.cpp defaults: temp 0.8, top-p 0.95, ...`), then the rest, e.g.
        `top-k off`, `max 256 tok` (those that do nothing at their neutral value, such as min-p 0, only when
        set)."""
        params, neutral, phrases = self.params, SamplingParams(), []
        grouped: list[str] = []
        for origin, given in (("model default", self.model_defaults), (LOCAL_ORIGIN, self.console_defaults)):
            names = [name for name in SETTINGS if name in given and name not in self.chosen]
            if names:
                phrases.append(f"{origin}: " + ", ".join(SETTINGS[name][2](getattr(params, name)) for name in names))
                grouped += names
        for name, (_, _, phrase) in SETTINGS.items():
            value = getattr(params, name)
            if name not in grouped and (name in ALWAYS_SHOWN or value != getattr(neutral, name)):
                phrases.append(phrase(value))
        return phrases + ([] if self.thinking is None else [f"thinking {'on' if self.thinking else 'off'}"])

    def set_thinking(self, text: str) -> None:
        """`/think on|off`: whether the chat template is asked to let the model think."""
        try:
            self.thinking = _flag(text.strip())
        except ValueError:
            raise ValueError(f"/think takes on or off; got {text.strip()!r}") from None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables this session sets (`enable_thinking`), if any (none without a template)."""
        return None if self.thinking is None or not self.chat else {"enable_thinking": self.thinking}

    def describe(self) -> str:
        return " · ".join(self.settings())

    def to_markdown(self) -> str:
        """The conversation as a Markdown document (the export)."""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.created))
        lines = [f"# {self.name}", "", f"_{when} · {self.describe()}_", ""]
        if self.system_prompt:
            lines += ["**System:**", "", self.system_prompt, ""]
        for turn in self.turns:
            lines += ["## You", "", turn.prompt, "", "## Assistant", "", turn.reply.text, "",
                      f"_{turn.reply.summary()}_", ""]
        return "\n".join(lines)
