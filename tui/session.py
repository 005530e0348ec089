"""Chat sessions as plain data: history, settings and per-reply stats.

Kept apart from the widgets so that a lost engine, a closed panel or a re-rendered tab never loses a
conversation, and so the rules (what history is sent, how a reply's numbers are computed) can be
read and tested without a terminal.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.service.protocol import Delta, Final, Params

DEFAULT_PARAMS = Params(max_tokens=256, temperature=0.8, top_p=0.95, top_k=-1)

def _flag(text: str) -> bool:
    if text.lower() in ("on", "true", "yes", "1"):
        return True
    if text.lower() in ("off", "false", "no", "0"):
        return False
    raise ValueError(text)


# The settings a person may change per session: name -> (parse, valid?, what is allowed).
SETTINGS: dict[str, tuple[Callable[[str], Any], Callable[[Any], bool], str]] = {
    "temperature": (float, lambda v: v >= 0, "0 or more (0 = greedy)"),
    "top_p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (int, lambda v: v == -1 or v >= 1, "-1 (off) or at least 1"),
    "max_tokens": (int, lambda v: v >= 1, "at least 1"),
    "ignore_eos": (_flag, lambda v: True, "on or off"),
}


def parse_setting(name: str, text: str) -> Any:
    """The value of setting `name` written as `text`; ValueError naming the allowed range otherwise."""
    parse, valid, allowed = SETTINGS[name]
    try:
        value = parse(text.strip())
    except ValueError:
        raise ValueError(f"{name} must be {allowed}; got {text.strip()!r}") from None
    if not valid(value):
        raise ValueError(f"{name} must be {allowed}; got {value}")
    return value


@dataclass
class Reply:
    """One assistant reply as it streams in. `state` moves queued -> streaming -> one of done, aborted,
    error or interrupted (the engine went away); the text that arrived is always kept."""

    rid: str
    text: str = ""
    state: str = "queued"
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    ttft: float | None = None
    total: float | None = None
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
        self.completion_tokens += len(out.token_ids)
        self.state = "streaming"
        if isinstance(out, Final):
            self.finish_reason = out.finish_reason
            self.state = "aborted" if out.finish_reason == "abort" else "done"
            self.prompt_tokens = out.usage.prompt_tokens
            self.completion_tokens = out.usage.completion_tokens
            self.ttft = out.timings.ttft if out.timings.ttft is not None else self.ttft
            self.total = out.timings.total

    def fail(self, state: str, why: str) -> None:
        """End without a Final: `error` (refused) or `interrupted` (engine lost); the text stays."""
        self.state, self.error, self.total = state, why, time.monotonic() - self.started

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: tokens after the first over the time after the first (what a reader feels)."""
        if self.ttft is None or self.total is None or self.completion_tokens < 2 or self.total <= self.ttft:
            return None
        return (self.completion_tokens - 1) / (self.total - self.ttft)

    def summary(self) -> str:
        """One line of numbers for under the reply, e.g. `12 → 40 tok · TTFT 0.08 s · 31.5 tok/s · aborted`."""
        prompt = "" if self.prompt_tokens is None else f"{self.prompt_tokens} → "
        parts = [f"{prompt}{self.completion_tokens} tok"]
        if self.ttft is not None:
            parts.append(f"TTFT {self.ttft:.2f} s")
        if (rate := self.tokens_per_s) is not None:
            parts.append(f"{rate:.1f} tok/s")
        if self.state == "done":
            parts.append(self.finish_reason or "done")
        elif self.state in ("aborted", "error", "interrupted"):
            parts.append(self.state + (f": {self.error}" if self.error else ""))
        return " · ".join(parts)


@dataclass
class Turn:
    prompt: str
    reply: Reply


_ids = iter(range(1, 1 << 62))


@dataclass
class Session:
    """A conversation with its own system prompt and sampling parameters."""

    name: str
    system_prompt: str = ""
    params: Params = DEFAULT_PARAMS
    turns: list[Turn] = field(default_factory=list)
    sid: int = field(default_factory=lambda: next(_ids))

    @property
    def live(self) -> Reply | None:
        """The reply still generating, if any (a session runs one request at a time)."""
        return self.turns[-1].reply if self.turns and self.turns[-1].reply.live else None

    def messages(self, prompt: str) -> list[dict[str, str]]:
        """The chat history plus `prompt`, for the engine to render with the model's chat template.

        Turns whose reply has no text are left out, so user and assistant messages alternate (some
        templates refuse anything else); an aborted reply's partial text counts as said.
        """
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for turn in self.turns:
            if turn.reply.text:
                msgs += [{"role": "user", "content": turn.prompt}, {"role": "assistant", "content": turn.reply.text}]
        return [*msgs, {"role": "user", "content": prompt}]

    def start_turn(self, prompt: str) -> Turn:
        """Record a new prompt with an empty reply whose request id names this session."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")[:16] or "chat"
        turn = Turn(prompt, Reply(rid=f"{slug}-{len(self.turns) + 1}-{uuid.uuid4().hex[:6]}"))
        self.turns.append(turn)
        return turn

    def set(self, name: str, text: str) -> None:
        """Change one sampling setting from its text form (ValueError if out of range)."""
        self.params = msgspec.structs.replace(self.params, **{name: parse_setting(name, text)})

    def describe(self) -> str:
        p = self.params
        top_k = "off" if p.top_k == -1 else p.top_k
        eos = " · ignore EOS" if p.ignore_eos else ""
        return f"temp {p.temperature:g} · top-p {p.top_p:g} · top-k {top_k} · max {p.max_tokens} tok{eos}"
