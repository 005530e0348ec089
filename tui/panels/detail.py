"""One request in detail (k9s' describe): enter on a row of the waiting queue or the running set.

Who sent it, its prompt's ends, its sampling parameters and priority, how much of the prompt the
prefix cache held, its slot and pages, its timings, and its output as it streams. The engine answers
`describe` for any client's request (docs/protocol.md), so the view polls that a few times a second,
asking only for the output it has not seen; once the request is gone it says so and keeps what it
saw. `x` asks to abort it, under the same rules as the tables (tui/panels/abort.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import msgspec
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from engine.params import SamplingParams
from engine.service.protocol import Description
from tui.names import printable
from tui.panels.base import update_text
from tui.panels.requests import REASONS

if TYPE_CHECKING:
    from tui.link import EngineLink

POLL = 0.25  # seconds between two looks at the request (the stats come as often)
ALWAYS = ("max_tokens", "temperature")  # parameters shown even at their defaults
KEY_WIDTH = 10


def describe_params(params: SamplingParams) -> str:
    """The parameters that say something: max_tokens and temperature, and whatever is not a default."""
    defaults = msgspec.structs.asdict(SamplingParams())
    parts = []
    for name, value in msgspec.structs.asdict(params).items():
        if name == "priority" or (name not in ALWAYS and value == defaults[name]):
            continue
        if name == "logit_bias" and value is not None:
            value = f"{len(value)} tokens"
        elif name == "structured" and value is not None:
            value = value.kind
        parts.append(f"{name} {value}")
    return " · ".join(parts)


def seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s"


class RequestDetailScreen(ModalScreen[None]):
    """A live description of one request; escape or q closes it, x asks to abort it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("x,delete", "abort", "Abort this request (asks first)"),
        Binding("escape,q", "dismiss", "Close the request detail"),
    ]

    def __init__(self, rid: str, link: EngineLink, abort: Callable[[str], None]) -> None:
        """`abort(rid)` asks the person and aborts (the ops panels' confirmation)."""
        super().__init__(classes="dialog")
        self.rid, self.link, self.abort = rid, link, abort
        self.last: Description | None = None  # the last description of the live request
        self.gone = False
        self.output = ""

    def compose(self) -> ComposeResult:
        with Vertical(id="detail") as box:
            box.border_title = f"Request {self.link.names.label(self.rid, 60)}"
            box.border_subtitle = "x abort · escape close"
            yield Static(id="detail-facts")
            yield Static(id="detail-prompt")
            with VerticalScroll(id="detail-output"):
                yield Static(id="detail-text")

    def on_mount(self) -> None:
        """Draw what is known now (the owner; the engine answers `describe` between steps, so during a long one
        the first answer takes a while), then follow the request."""
        update_text(self.query_one("#detail-facts", Static), self.facts(reachable=True))
        self.run_worker(self.follow(), name="describe", exclusive=True)

    async def follow(self) -> None:
        """Ask the engine about the request until it is gone; the output comes a piece at a time."""
        while not self.gone:
            described = await self.link.describe(self.rid, len(self.output))
            self.show(described)
            if not self.gone:
                await asyncio.sleep(POLL)

    def show(self, d: Description | None) -> None:
        """Draw a description (None: the engine could not be asked this time)."""
        if d is not None and d.state == "gone":
            self.gone = True
        elif d is not None:
            self.last = d
            if d.output:
                self.output += d.output
                self.append_output()
        update_text(self.query_one("#detail-facts", Static), self.facts(reachable=d is not None))
        if self.last is not None:
            head, tail = printable(self.last.prompt_head), printable(self.last.prompt_tail)
            prompt = Text.assemble(("prompt    ", "bold"), head, *((" … ", "grey50"), tail) if tail else ())
            update_text(self.query_one("#detail-prompt", Static), prompt)

    def append_output(self) -> None:
        scroll = self.query_one("#detail-output", VerticalScroll)
        at_end = scroll.scroll_y >= scroll.max_scroll_y
        self.query_one("#detail-text", Static).update(Text(printable(self.output)))
        if at_end:
            scroll.call_after_refresh(scroll.scroll_end, animate=False)

    def facts(self, reachable: bool) -> Text:
        """Key / value lines, one fact each."""
        d = self.last
        lines: list[tuple[str, str]] = []
        names = self.link.names
        if d is None:
            state = "no longer live (finished or aborted)" if self.gone else "asking the engine…"
            lines += [("owner", names.owner(self.rid)),
                      ("state", state if reachable or self.gone else "the engine does not answer")]
        else:
            owner = names.owner(self.rid) if names.is_own(self.rid) else (printable(d.client) or "?")
            lines += [("owner", owner), ("state", self.state_text(d, reachable))]
            if d.params is not None:
                lines += [("priority", str(d.params.priority)), ("params", describe_params(d.params))]
            if d.prompt_tokens:
                share = f"{100 * d.cached_tokens / d.prompt_tokens:.0f}%"
                tiers = f": {d.cached_tokens - d.host_tokens - d.disk_tokens} in the pool, {d.host_tokens} from host " \
                        f"memory, {d.disk_tokens} from disk" if d.host_tokens or d.disk_tokens else ""
                lines.append(("prompt", f"{d.prompt_tokens} tokens, {d.cached_tokens} from the prefix cache "
                                        f"({share}){tiers}"))
            if d.slot is not None or d.pages:
                slot = f"slot {d.slot} · " if d.slot is not None else ""
                pool = self.link.stats.pages if self.link.stats is not None else None
                kind = f" ({pool.dtype}, {d.pages * pool.page_bytes / 2**20:.1f} MiB)" \
                    if pool is not None and pool.dtype and pool.page_bytes else ""
                lines.append(("memory", f"{slot}{d.pages} KV pages held{kind}, {d.claimed_pages} more claimed"))
            output = f"{d.generated}/{d.max_tokens} tokens"
            if d.retractions:
                output += f" · retracted ×{d.retractions}"
            if d.choices > 1:
                output += f" · choice 1 of {d.choices} shown"
            lines.append(("output", output))
            if d.spec is not None and d.spec.verifications:
                s = d.spec
                lines.append(("drafts", f"{s.accepted_tokens} of {s.draft_tokens} accepted in {s.verifications} "
                                        f"verifications ({s.mean_accepted_length:.2f} tokens each)"))
            rate = ""
            if d.ttft is not None and d.generated > 1 and d.age > d.ttft:
                rate = f" · decoding at {(d.generated - 1) / (d.age - d.ttft):.1f} tok/s since its first token"
            lines.append(("timings", f"age {d.age:.1f} s · queued {seconds(d.queue)} · first token "
                                     f"{seconds(d.ttft)}{rate}"))
        text = Text()
        for i, (key, value) in enumerate(lines):
            text.append("\n" * (i > 0)).append(f"{key:<{KEY_WIDTH}}", "bold").append(value)
        return text

    def state_text(self, d: Description, reachable: bool) -> str:
        if self.gone:
            return "no longer live (finished or aborted); what it was last:"
        if not reachable:
            return f"{d.state} when last seen; the engine does not answer now"
        if d.state == "waiting" and d.reason == "loading_kv":
            return "waiting: its prompt's KV loads back from host memory or disk"
        if d.state == "waiting":
            return f"waiting for {REASONS.get(d.reason, (d.reason or '?', ''))[0]}"
        if d.state == "prefilling":
            return "prefilling its prompt"
        return {"running": "decoding", "tokenizing": "its text prompt is being tokenized"}.get(d.state, d.state)

    def action_abort(self) -> None:
        self.abort(self.rid)
