"""Chat sessions as plain data: history, settings and per-reply stats.

Kept apart from the widgets so that a lost engine, a closed panel or a re-rendered tab never loses a
conversation, and so the rules (what history is sent, how a reply's numbers are computed) can be
read and tested without a terminal.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.outputs import Delta, Final
from engine.params import SamplingParams

DEFAULT_PARAMS = SamplingParams(max_tokens=256, temperature=0.8, top_p=0.95, top_k=-1)
TITLE_WIDTH = 30  # characters of an automatic title


def _flag(text: str) -> bool:
    if text.lower() in ("on", "true", "yes", "1"):
        return True
    if text.lower() in ("off", "false", "no", "0"):
        return False
    raise ValueError(text)


# The settings a person may change per session: name -> (parse, what is allowed). The range itself is
# SamplingParams' to check, as the engine checks it.
SETTINGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "temperature": (float, "a number, 0 or more (0 = greedy)"),
    "top_p": (float, "a number in (0, 1]"),
    "top_k": (int, "-1 (off) or an integer of at least 1"),
    "max_tokens": (int, "an integer of at least 1"),
    "ignore_eos": (_flag, "on or off"),
    "priority": (int, "an integer (lower runs first under --schedule-policy priority; default 0)"),
}


def parse_setting(name: str, text: str) -> Any:
    """The value of setting `name` written as `text`; ValueError naming the allowed range otherwise."""
    parse, allowed = SETTINGS[name]
    try:
        value = parse(text.strip())
    except ValueError:
        raise ValueError(f"{name} must be {allowed}; got {text.strip()!r}") from None
    SamplingParams(**{name: value})  # InvalidParams (a ValueError) in the engine's words
    return value


@dataclass
class Reply:
    """One assistant reply as it streams in. `state` moves queued -> streaming -> one of done, aborted,
    error or interrupted (the engine went away); the text that arrived is always kept.

    Two clocks, shown apart because they answer different questions: `ttft` and `total` are the
    person's, from the moment the message was sent (`started`) to its first token and to its end;
    `queue` and `engine_ttft` are the engine's own (the Final's timings, from when the engine received
    the request): how long it waited for admission, and until its first token (so prefill is the
    difference). A slow console or a busy link shows in the first and not in the second."""

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
            self.prompt_tokens = out.usage.prompt_tokens
            self.completion_tokens = out.usage.completion_tokens
            self.queue, self.engine_ttft = out.timings.queue, out.timings.ttft
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
    def tokens_per_s(self) -> float | None:
        """Decode speed: tokens after the first over the time after the first (what a reader feels)."""
        if self.ttft is None or self.total is None or self.completion_tokens < 2 or self.total <= self.ttft:
            return None
        return (self.completion_tokens - 1) / (self.total - self.ttft)

    def engine_split(self) -> str | None:
        """The engine's side of the wait, e.g. `engine: 1.70 s queued + 0.10 s prefill` (None before the Final)."""
        if self.engine_ttft is None:
            return None
        if self.queue is None:
            return f"engine: first token {self.engine_ttft:.2f} s"
        return f"engine: {self.queue:.2f} s queued + {self.engine_ttft - self.queue:.2f} s prefill"

    def summary(self) -> str:
        """One line of numbers for under the reply, e.g. `12 → 40 tok · first token in 1.84 s (engine: 1.70 s
        queued + 0.10 s prefill) · 31.5 tok/s · stop`."""
        prompt = "" if self.prompt_tokens is None else f"{self.prompt_tokens} → "
        parts = [f"{prompt}{self.completion_tokens} tok"]
        if self.ttft is not None:
            split = self.engine_split()
            parts.append(f"first token in {self.ttft:.2f} s" + (f" ({split})" if split else ""))
        if (rate := self.tokens_per_s) is not None:
            parts.append(f"{rate:.1f} tok/s")
        if self.state == "done" and self.context_full:
            parts.append("length: the model's context is full (/clear starts afresh)")
        elif self.state == "done":
            parts.append(self.finish_reason or "done")
        elif self.state in ("aborted", "error", "interrupted"):
            parts.append(self.state + (f": {self.error}" if self.error else ""))
        return " · ".join(parts)


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
    """A conversation with its own system prompt and sampling parameters.

    Turns before `context_start` stay on screen and in the store but are no longer sent: the oldest
    turns are dropped when the history outgrows the model's context, and `/clear` drops them all.
    `titled`: the name is a person's or already the automatic title, not the console's `chat N`.
    `group`: the fan-out this session belongs to; such a session is scratch, never saved, until kept.
    """

    name: str
    system_prompt: str = ""
    params: SamplingParams = DEFAULT_PARAMS
    turns: list[Turn] = field(default_factory=list)
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    context_start: int = 0
    titled: bool = False
    group: str | None = None
    thinking: bool | None = None  # `/think on|off`: enable_thinking for the chat template; None: its default

    @property
    def live(self) -> Reply | None:
        """The reply still generating, if any (a session runs one request at a time)."""
        return self.turns[-1].reply if self.turns and self.turns[-1].reply.live else None

    def messages(self, prompt: str, start: int | None = None) -> list[dict[str, str]]:
        """The history from turn `start` (default: what is still in context) plus `prompt`, for the engine
        to render with the chat template.

        Turns whose reply has no text are left out, so user and assistant messages alternate (some
        templates refuse anything else); an aborted reply's partial text counts as said.
        """
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for turn in self.turns[self.context_start if start is None else start:]:
            if turn.reply.text:
                msgs += [{"role": "user", "content": turn.prompt}, {"role": "assistant", "content": turn.reply.text}]
        return [*msgs, {"role": "user", "content": prompt}]

    async def fit(self, prompt: str, context: int, count: Callable[[list[dict[str, str]]], Awaitable[int]]) -> int:
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
            return await count(self.messages(prompt, start)) <= room

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
        """Tokens of the context the last reply filled (its prompt and its own tokens)."""
        for turn in reversed(self.turns[self.context_start:]):
            if turn.reply.prompt_tokens is not None:
                return turn.reply.prompt_tokens + turn.reply.completion_tokens
        return None

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
        """Change one sampling setting from its text form (ValueError if out of range)."""
        self.params = msgspec.structs.replace(self.params, **{name: parse_setting(name, text)})

    def settings(self) -> list[str]:
        """The sampling settings as short phrases, e.g. `temp 0.8`, `top-k off` (wrapped between, never inside)."""
        p = self.params
        phrases = [f"temp {p.temperature:g}", f"top-p {p.top_p:g}", f"top-k {'off' if p.top_k == -1 else p.top_k}",
                   f"max {p.max_tokens} tok"]
        thinking = [] if self.thinking is None else [f"thinking {'on' if self.thinking else 'off'}"]
        return phrases + ["ignore EOS"] * p.ignore_eos + [f"priority {p.priority}"] * bool(p.priority) + thinking

    def set_thinking(self, text: str) -> None:
        """`/think on|off`: whether the chat template is asked to let the model think."""
        try:
            self.thinking = _flag(text.strip())
        except ValueError:
            raise ValueError(f"/think takes on or off; got {text.strip()!r}") from None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables this session sets (`enable_thinking`), if any."""
        return None if self.thinking is None else {"enable_thinking": self.thinking}

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
