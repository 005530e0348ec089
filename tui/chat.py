"""One chat session on screen: the conversation, its settings line and the prompt box.

A ChatPane streams its own replies (one request at a time) through the app's engine link, so each
tab generates independently of the others and closing a tab aborts only its own request.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

import msgspec
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.geometry import Size
from textual.message import Message
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Markdown, Static, TextArea
from textual.worker import WorkerCancelled, WorkerFailed

from engine.params import SamplingParams
from engine.service.client import AsyncEngineClient, EngineError, EngineUnavailable
from tui.commands import parse_number
from tui.keys import InOrderKeys
from tui.names import printable
from tui.panels.base import pack, update_text
from tui.session import SETTINGS, EngineModel, Reply, Session, Turn, encodable, parse_setting

if TYPE_CHECKING:
    from tui.link import EngineLink


PLACEHOLDER = "Message · enter: send · ctrl+j: new line · /help: commands · f1: keys"
HINT = """\
Type a message and press **enter**; **ctrl+j** starts a new line, and pasted text keeps its lines.
**escape** stops a reply; a message sent meanwhile waits its turn. **pageup**/**pagedown** scroll.
**up** in an empty box edits your last message, **ctrl+r** regenerates the last reply, `/copy` copies it.
Settings (from the model's own): `/temperature 0.7`, `/max_tokens 128`, `/system You are terse.`; `/reset`
goes back to the model's; `/clear` starts afresh.
**ctrl+o** lists saved conversations, **ctrl+t** the open tabs (then **1**-**9** jumps to one);
**ctrl+f** fans a prompt out to several tabs at once (**ctrl+g** closes them all); **f5** shows the
ops panels to watch them batch. **f1** lists every key, **ctrl+p** every command.
"""
GAUGE = 8  # cells of the context gauge
GAUGE_EVERY = 0.25  # seconds between two redraws of the gauge while a reply streams


def displayed(widget: Widget) -> bool:
    """Displayed, as are all its ancestors (not in a hidden tab): a hidden widget does no drawing work."""
    return all(node.display for node in widget.ancestors_with_self if isinstance(node, Widget))


class PromptInput(InOrderKeys, TextArea):
    """Multi-line prompt box: Enter sends, ctrl+j starts a new line (the one new-line key every
    terminal and multiplexer passes through), page keys scroll the conversation above. Pasted text
    goes in unchanged, newlines included (TextArea's paste). Keys apply in the order typed (InOrderKeys)."""

    BINDINGS = [
        Binding("enter", "send", "Send"),
        Binding("ctrl+j", "newline", "New line", show=False),
        Binding("up", "edit_last", "In an empty box: edit your last message and send it again", show=False),
        Binding("pageup", "scroll_log('page_up')", "Scroll the conversation up", show=False),
        Binding("pagedown", "scroll_log('page_down')", "Scroll the conversation down", show=False),
        Binding("ctrl+home", "scroll_log('home')", "Scroll to the first message", show=False),
        Binding("ctrl+end", "scroll_log('end')", "Scroll to the last message", show=False),
    ]

    class Submitted(Message):
        def __init__(self, prompt_input: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt_input, self.text = prompt_input, text

    class EditLast(Message):
        """Up in an empty box: the last message back in the box, to edit and send again."""

        def __init__(self, prompt_input: PromptInput) -> None:
            super().__init__()
            self.prompt_input = prompt_input

    BLINK_FOR = 10.0
    """Seconds the cursor blinks after the last key (or focus); then it stays lit, as in many terminals,
    so that a console left alone repaints nothing at all."""
    _blink_until = 0.0

    def __init__(self, *, classes: str | None = None) -> None:
        super().__init__(soft_wrap=True, highlight_cursor_line=False, placeholder=PLACEHOLDER, classes=classes)

    def _restart_blink(self) -> None:  # TextArea's, on every key, paste and focus
        self._blink_until = time.monotonic() + self.BLINK_FOR
        super()._restart_blink()

    def _toggle_cursor_blink_visible(self) -> None:  # TextArea's, on its blink timer
        if time.monotonic() > self._blink_until:
            self._pause_blink(visible=True)  # lit, and the timer waits for the next _restart_blink
        else:
            super()._toggle_cursor_blink_visible()

    def action_send(self) -> None:
        if self.text.strip():
            self.post_message(self.Submitted(self, encodable(self.text)))
            self.clear()

    def action_newline(self) -> None:
        self.insert("\n")

    def action_edit_last(self) -> None:
        if self.text:
            self.action_cursor_up()
        else:
            self.post_message(self.EditLast(self))

    def action_scroll_log(self, how: str) -> None:
        """Scroll the conversation: `page_up`, `page_down`, `home` or `end`. Scrolling up lets go of
        the log's anchor (else the next streamed token pulls it back down); reaching the end restores it."""
        log = self.query_ancestor(ChatPane).query_one(".chat-log", VerticalScroll)
        if how in ("page_up", "home"):
            log.release_anchor()
        getattr(log, f"scroll_{how}")(animate=False)


class PhraseLine(Static):
    """Phrases joined by ` · ` that wrap between phrases, never inside one: the settings line in 80
    columns reads `top-k off` on one line, not `top-k` at the end of one and `off` on the next, and a
    reply's footer keeps each of its numbers whole."""

    def __init__(self, classes: str) -> None:
        super().__init__(classes=classes)
        self.phrases: list[str] = []

    def show(self, phrases: list[str]) -> None:
        if phrases != self.phrases:
            self.phrases = phrases
            self.refresh(layout=True)

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return len(" · ".join(self.phrases))

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(pack(self.phrases, width))

    def render(self) -> Text:
        """The phrases packed to the width (on one line while the line has none: in a hidden tab)."""
        width = self.content_size.width
        return Text("\n".join(pack(self.phrases, width) if width else [" · ".join(self.phrases)]))


class ReplyView(Vertical):
    """An assistant reply: Markdown that grows as text streams in, and its footer of numbers under it (one
    phrase per field of the Reply's footer, tui/session.py, wrapped between phrases).

    While the reply streams, the view renders on a clock, not per token: a render re-parses the
    reply's last Markdown block and re-lays-out the screen, and with a few sessions streaming
    hundreds of tokens a second, rendering every token kept the app too busy to answer keys. Each
    frame appends all the text that arrived since the last one, so the text shown is the same, and
    `finish_streaming` appends the rest. A render costs more as the reply grows (a long paragraph
    is re-wrapped whole, a long reply re-laid-out), so frames are spaced by their cost too: twenty
    a second for an ordinary reply, fewer for a very long one.

    The clock stops while the view is hidden (its tab is not in front, or the ops panels fill the
    screen): a fan-out streams into dozens of hidden tabs, whose clocks would otherwise tick twenty
    times a second each for nothing. The view catches up when shown again (`wake`).

    A view may be made after its reply began streaming (a fan-out submits before it draws its tabs):
    it starts from the text there is when it is composed, and its clock starts once it is mounted.
    """

    FRAME = 1 / 20  # seconds between two renders of the streaming text, at least
    FRAME_COST = 8  # ... and at least this many times as long as an append takes (median of the last few)
    MAX_FRAME = 1.0  # ... but never longer than this
    STREAMING_REFRESH = 0.25  # seconds between two updates of the numbers while tokens stream in

    def __init__(self, reply: Reply, unfolded: bool = False) -> None:
        super().__init__(classes="reply")
        self.reply = reply
        self.unfolded = unfolded  # the thinking shown whole, not as one line (f3)
        self._shown_at = 0.0
        self._rendered = 0  # characters of reply.text in the Markdown
        self._rendering = asyncio.Lock()
        self._next_frame = 0.0
        self._append_times: deque[float] = deque(maxlen=5)
        self._frames: Timer | None = None

    def compose(self) -> ComposeResult:
        self._rendered = len(self.reply.text)
        yield Markdown(printable(self.reply.text))
        yield Static(classes="reply-thinking")
        yield PhraseLine(classes="reply-stats")

    async def on_mount(self) -> None:
        """A live reply streams from now on; one that ended since `compose` shows the text it still lacks."""
        self.refresh_state()
        if self.reply.live:
            self.start_streaming()
        else:
            await self.finish_streaming()

    def start_streaming(self) -> None:
        """Render the reply's text as it grows, a frame at a time, until `finish_streaming`."""
        if self._frames is None:
            self._frames = self.set_interval(self.FRAME, self._frame, pause=not self.on_screen)

    @property
    def on_screen(self) -> bool:
        return displayed(self)

    def wake(self) -> None:
        """The view may be on screen again: restart its clock if it streams (a no-op otherwise)."""
        if self._frames is not None and self.on_screen:
            self._frames.resume()

    def on_show(self) -> None:
        self.wake()

    async def finish_streaming(self) -> None:
        """Render the text not shown yet, and the reply's final state."""
        if self._frames is not None:
            self._frames.pause()  # a frame that is rendering finishes first (the lock)
        await self._append_new_text()
        if self._frames is not None:
            self._frames.stop()
            self._frames = None
        self.refresh_state()

    async def _frame(self) -> None:
        if not self.on_screen:  # hidden since the last frame: no frames until it is shown (`wake`)
            if self._frames is not None:
                self._frames.pause()
            return
        if time.monotonic() >= self._next_frame:
            await self._append_new_text()
            self.refresh_state()

    async def _append_new_text(self) -> None:
        """Append the text that arrived since the last render to the Markdown, as one piece."""
        async with self._rendering:
            text = self.reply.text
            markdown = next((child for child in self.children if isinstance(child, Markdown)), None)
            if markdown is None or len(text) <= self._rendered:  # not composed yet: it will be with the text
                return
            new, self._rendered = text[self._rendered:], len(text)
            began = time.monotonic()
            await markdown.append(printable(new))
            self._append_times.append(time.monotonic() - began)  # the median: one slow loop turn is no trend
            self._next_frame = began + min(self.MAX_FRAME, self.FRAME_COST * statistics.median(self._append_times))

    def refresh_state(self) -> None:
        """Show the reply's state and numbers; while streaming, a few times a second, not per frame
        (each update re-lays-out the screen, and eight sessions may be streaming)."""
        reply = self.reply
        now = time.monotonic()
        if reply.state == "streaming" and now - self._shown_at < self.STREAMING_REFRESH:
            return
        self._shown_at = now
        phrases = ["waiting for engine…"] if reply.state == "queued" else reply.footer()
        if reply.state == "streaming":
            phrases.append("streaming…")
        for stats in self.query(".reply-stats").results(PhraseLine):  # none while the view is torn down
            stats.show([printable(phrase) for phrase in phrases])
        self.show_thinking()
        for state in ("queued", "streaming", "done", "aborted", "error", "interrupted"):
            self.set_class(reply.state == state, f"-{state}")

    def show_thinking(self, unfolded: bool | None = None) -> None:
        """The reply's thinking under its text, dimmed: one line with its token count when folded, the
        whole of it when unfolded (`unfolded` None: as it was); nothing for a reply without any."""
        if unfolded is not None:
            self.unfolded = unfolded
        reply = self.reply
        for line in self.query(".reply-thinking").results(Static):
            line.display = bool(reply.reasoning or reply.reasoning_tokens)
            if not line.display:
                continue
            doing = "thinking…" if reply.live and not reply.text else "thought"
            head = f"{'▾' if self.unfolded else '▸'} {doing} · {reply.reasoning_tokens} tokens " \
                   f"(f3 {'folds' if self.unfolded else 'unfolds'})"
            update_text(line, Text(printable(head + ("\n" + reply.reasoning.strip() if self.unfolded else ""))))


class ChatPane(Vertical):
    """The widgets of one Session. The session object outlives the pane's requests and errors.

    A message sent while a reply is generating waits in `pending` (shown above the prompt box) and
    goes out when the reply ends, so typed text is never thrown away. A message being edited
    (`editing`) goes out in place of its old turn, and the turns after it are forgotten.

    A request may start before the pane is mounted (`start`): a fan-out submits all its requests
    first and draws the tabs after, so the engine has them all at once however long the drawing takes.
    """

    class StateChanged(Message):
        """A reply started or ended, so the tab label and the app's status can follow (and the app saves)."""

        def __init__(self, pane: ChatPane) -> None:
            super().__init__()
            self.pane = pane

    def __init__(self, session: Session, link: EngineLink) -> None:
        super().__init__(classes="chat")
        self.session = session
        self.link = link
        self.pending: list[str] = []
        self.editing: int | None = None  # the turn whose message is back in the prompt box
        self.closing = False
        self.warmed: int | None = None  # the engine (pid) that has this conversation's KV, as far as the pane knows
        self.other_said: str | None = None  # the "another model" notice this pane last gave
        self._gauge_at = 0.0  # when the context gauge was last drawn
        self.thinking_unfolded = False  # f3: replies' thinking shown whole

    def compose(self) -> ComposeResult:
        with Horizontal(classes="chat-bar"):
            yield PhraseLine(classes="chat-settings")
            yield Static(classes="chat-gauge")
        yield PhraseLine(classes="chat-note")
        with VerticalScroll(classes="chat-log"):
            if not self.session.turns:
                yield Markdown(HINT, classes="chat-hint")
            for turn in self.session.turns:
                yield from self._turn_widgets(turn)
        yield Static(classes="chat-pending")
        yield PromptInput(classes="chat-input")

    async def on_mount(self) -> None:
        self.query_one(".chat-log", VerticalScroll).anchor()
        self.follow_engine()
        self.show_pending()
        await self.show_context_mark()

    def follow_engine(self) -> None:
        """The pane's engine answered (first, again, or another one): the session takes its model's sampling
        defaults and chat template, and the header says which model it is, and whether the conversation was
        had with another (said once as a notification too)."""
        info = self.link.info
        if info is None:
            self.show_settings()
            return
        self.session.follow(EngineModel.of(info))
        self.show_settings()
        self.keep_warm()

    def say_other_model(self) -> None:
        """Notify once that the conversation was had with another model (the app asks the chat in front: a restart
        with five chats open gave five notices over half the screen; the others say theirs when opened, and the
        note in each header stays)."""
        other = self.session.other_model()
        if other is not None and other != self.other_said and self.is_attached:
            self.other_said = other
            self.notify(f"{self.session.name}: {other}", title="another model", severity="warning", timeout=10)

    @property
    def context(self) -> int | None:
        """The model's context in tokens, once an engine has said."""
        return self.link.info.max_seq_len if self.link.info is not None else None

    def show_settings(self) -> None:
        """The header: the model, the system prompt and the settings, the context gauge, and a note when the
        conversation was had with another model than the engine's."""
        if not self.is_attached or self.closing:  # stats arrive at any time, also while the pane goes
            return
        session = self.session
        system = printable(session.system_prompt.replace("\n", " "))
        if system and not session.takes_system:
            system = f"system, sent in the first message (the model's chat template has no system role): {system}"
        elif system:
            system = f"system: {system}"
        elif session.engine is not None and session.engine.default_system:  # what the model sees: its template's
            system = f"system (the chat template's own): {printable(session.engine.default_system)}"
        model = [printable(session.engine.name)] if session.engine is not None else []
        if not session.chat:  # a base model: say how it is talked to
            model.append("completion: no chat template (a base model), so it continues the text, each message on "
                         "a new line")
        self.query_one(".chat-settings", PhraseLine).show([*model, system or "no system prompt",
                                                           *session.settings()])
        note = self.query_one(".chat-note", PhraseLine)
        other = session.other_model()
        note.display = other is not None
        note.show([printable(other)] if other is not None else [])
        self.show_gauge()

    def show_gauge(self) -> None:
        """The context gauge: tokens used of the model's context (while a reply streams, at least that many)."""
        if not self.is_attached or self.closing:
            return
        self._gauge_at = time.monotonic()
        used, context = self.session.context_used or 0, self.context
        gauge = Text("context ")
        if context:
            filled = min(GAUGE, round(GAUGE * used / context))
            style = "red" if used > 0.9 * context else "yellow" if used > 0.75 * context else "green"
            gauge.append("▰" * filled, style).append("▱" * (GAUGE - filled), "grey39")
        gauge.append(f" {'' if self.session.context_settled else '≥'}{used}/{context or '?'}")
        update_text(self.query_one(".chat-gauge", Static), gauge)

    def show_pending(self) -> None:
        """Above the prompt box: the message being edited, and those queued behind the streaming reply."""
        lines = []
        if self.editing is not None:
            after = len(self.session.turns) - self.editing - 1
            dropped = f", forgetting the {after} turn{'s' * (after > 1)} after it" if after else ""
            lines.append(f"editing message {self.editing + 1}: enter sends it in place of the old one{dropped} "
                         f"(escape cancels)")
        if self.pending:
            waiting = " · ".join(printable(p.replace("\n", " ")) for p in self.pending)
            lines.append(f"queued, sent when this reply ends (escape stops it): {waiting}")
        pending = self.query_one(".chat-pending", Static)
        pending.display = bool(lines)
        if lines:
            update_text(pending, Text("\n".join(lines)))

    async def show_context_mark(self) -> None:
        """A rule above the first turn still sent to the model, when older ones are not."""
        await self.query(".context-mark").remove()
        start, users = self.session.context_start, list(self.query(".user"))
        if not start or start > len(users):
            return
        mark = Static(Text(f"▲ the {start} turn{'s' * (start > 1)} above {'are' if start > 1 else 'is'} no longer "
                           f"sent to the model (trimmed to fit its context, or /clear)"), classes="context-mark")
        log = self.query_one(".chat-log", VerticalScroll)
        await (log.mount(mark, before=users[start]) if start < len(users) else log.mount(mark))

    def focus_input(self) -> None:
        self.query_one(PromptInput).focus()

    def wake(self) -> None:
        """The pane is in front again: a reply streaming meanwhile starts rendering (and catches up), and a
        conversation its engine has not seen yet is sent ahead (`keep_warm`)."""
        if (reply := self.session.live) is not None and (view := self._view_of(reply)) is not None:
            view.wake()
        self.show_gauge()  # a reply that streamed while hidden filled the context meanwhile
        self.keep_warm()

    def keep_warm(self) -> None:
        """A conversation in front whose engine has not seen it (reopened from the store, or its engine restarted)
        is sent to it ahead of the next message, as its history alone, to prefill and nothing more (max_tokens 0):
        the engine finds its KV pages on its disk tier where it wrote them before, and the next message starts from
        a warm prefix cache instead of computing the whole conversation. Nothing is shown; a failure is silent."""
        info = self.link.info
        said = any(turn.reply.text for turn in self.session.turns[self.session.context_start:])
        if info is None or info.pid == self.warmed or self.session.live is not None or self.closing or not said \
                or not all(n.display for n in self.ancestors_with_self if isinstance(n, Widget)):
            return
        self.warmed = info.pid
        self.run_worker(self._warm(), group="warm", exclusive=True, exit_on_error=False)

    async def _warm(self) -> None:
        with contextlib.suppress(EngineError, EngineUnavailable):
            client = await self.link.ready()
            label = f"console: {self.session.name} (resuming)"[:128]
            warm = client.generate(self.session.request(None), SamplingParams(max_tokens=0), client=label,
                                   template_kwargs=self.session.template_kwargs())
            async with contextlib.aclosing(warm) as stream:  # cancelled (the pane closes): aborted in the engine
                async for _ in stream:
                    pass

    def _view_of(self, reply: Reply) -> ReplyView | None:
        """The view showing `reply`, if the pane has drawn it yet."""
        return next((view for view in self.query(ReplyView) if view.reply is reply), None)

    def _turn_widgets(self, turn: Turn) -> tuple[Static, ReplyView]:
        return Static(Text(printable(turn.prompt)), classes="user"), ReplyView(turn.reply, self.thinking_unfolded)

    def toggle_thinking(self) -> None:
        """f3: every reply's thinking in this session unfolded, or folded to one line again."""
        self.thinking_unfolded = not self.thinking_unfolded
        for view in self.query(ReplyView):
            view.show_thinking(self.thinking_unfolded)

    def start(self, prompt: str) -> Reply:
        """Start a turn and its request now, whether or not the pane is drawn yet (`compose` draws the
        turns there are, the live one included)."""
        turn = self.session.start_turn(prompt)
        self.link.names.own(turn.reply.rid, f"{self.session.name} #{len(self.session.turns)}")
        self._generate(turn.reply, prompt)
        return turn.reply

    async def send(self, prompt: str) -> Reply | None:
        """Start a turn, or queue the prompt while a reply is still generating (one request per
        session at a time); None when queued."""
        if self.session.live is not None:
            self.pending.append(prompt)
            self.show_pending()
            return None
        reply = self.start(prompt)
        await self.query(".chat-hint").remove()
        log = self.query_one(".chat-log", VerticalScroll)
        await log.mount_all(self._turn_widgets(self.session.turns[-1]))
        log.scroll_end(animate=False)  # scrolled back (pageup) or not, the new reply streams in view
        self.post_message(self.StateChanged(self))
        return reply

    async def _send_pending(self) -> None:
        if self.pending and self.session.live is None:
            prompt = self.pending.pop(0)
            self.show_pending()
            await self.send(prompt)

    def edit(self, number: str = "") -> None:
        """/edit N: put message N (default: the last) back in the prompt box; Enter then sends it, edited, in
        place of its turn."""
        index = (parse_number(number, "/edit") or len(self.session.turns)) - 1
        if self.session.live is not None:
            raise ValueError("a reply is still streaming: stop it first (escape), then edit")
        if not self.session.turns:
            raise ValueError("nothing to edit: send a message first")
        if not 0 <= index < len(self.session.turns):
            raise ValueError(f"there is no message {index + 1} to edit: this conversation has "
                             f"{len(self.session.turns)}")
        self.editing = index
        box = self.query_one(PromptInput)
        box.text = self.session.turns[index].prompt
        box.move_cursor(box.document.end)
        self.show_pending()
        self.focus_input()

    def cancel_edit(self) -> bool:
        """Stop editing (the box empties); False if nothing was being edited."""
        if self.editing is None:
            return False
        self.editing = None
        self.query_one(PromptInput).clear()
        self.show_pending()
        return True

    async def resend(self, index: int, prompt: str) -> Reply | None:
        """Send `prompt` in place of turn `index`, forgetting that turn and every later one (edit, regenerate)."""
        if self.session.live is not None:
            raise ValueError("a reply is still streaming: stop it first (escape)")
        self.editing = None
        log = self.query_one(".chat-log", VerticalScroll)
        await log.remove_children([*log.query(".user")][index:] + [*log.query(ReplyView)][index:])
        self.session.truncate(index)
        self.show_pending()
        await self.show_context_mark()
        return await self.send(prompt)

    async def regenerate(self) -> Reply | None:
        """Ask again for the last reply: its message is sent anew in place of the last turn."""
        if not self.session.turns:
            raise ValueError("nothing to regenerate: send a message first")
        return await self.resend(len(self.session.turns) - 1, self.session.turns[-1].prompt)

    async def clear(self) -> None:
        """/clear: the model sees none of the conversation so far."""
        self.session.clear()
        await self.show_context_mark()
        self.show_settings()

    # -- the commands that change only this session (tui/commands.py; MinichatApp.command_handlers) -----
    def set_system_prompt(self, text: str) -> None:
        self.session.system_prompt = text

    def set_setting(self, name: str, value: str) -> None:
        """Every sampling setting (tui/session.py's SETTINGS); max_tokens must also fit the model's context."""
        if name == "max_tokens" and self.context is not None and parse_setting(name, value) >= self.context:
            raise ValueError(f"max_tokens must be below the model's context of {self.context} tokens; got {value}")
        self.session.set(name, value)

    def reset(self) -> None:
        """/reset: the sampling settings back to the model's recommendations (the console's where it has none)."""
        self.session.reset()
        defaults = self.session.model_defaults
        where = "the model's defaults" if defaults else "llama.cpp's defaults (the model recommends none)"
        self.notify(f"{self.session.name}: sampling settings back to {where}: {self.session.describe()}")

    def copy_reply(self, number: str = "") -> None:
        """/copy N: reply N's text (default: the last) through the terminal (OSC 52), which most terminals put
        on the clipboard."""
        turns = self.session.turns
        n = parse_number(number, "/copy") or len(turns)
        if not 1 <= n <= len(turns):
            raise ValueError(f"there is no reply {n} to copy: this conversation has {len(turns)}")
        text = turns[n - 1].reply.text
        self.app.copy_to_clipboard(text)
        self.notify(f"copied reply {n} ({len(text)} characters) through the terminal (OSC 52; in tmux it needs "
                    f"`set -g set-clipboard on`)", title="copy")

    def keep(self) -> None:
        """/keep: a fan-out's scratch tab becomes an ordinary conversation, saved from now on."""
        if self.session.group is None:
            raise ValueError(f"{self.session.name!r} is not a fan-out tab: it is saved already")
        self.session.group = None
        self.notify(f"kept {self.session.name!r}: saved, and reopened at the next start")

    def present_value(self, name: str) -> str:
        """What command `name`'s dialog starts with: the setting's present value."""
        if name in SETTINGS:
            return str(getattr(self.session.params, name))
        return {"rename": self.session.name, "system": self.session.system_prompt,
                "fanout": f"4 {self.query_one(PromptInput).text.strip() or 'Tell me a story'}"}.get(name, "")

    async def _fit(self, client: AsyncEngineClient, prompt: str) -> None:
        """Drop the oldest turns that no longer fit the model's context, as the engine counts tokens, and
        say so."""
        async def count(request: str | list[dict[str, str]]) -> int:
            return len(await client.tokenize(request))

        if self.context is not None and (dropped := await self.session.fit(prompt, self.context, count)):
            self.notify(f"{self.session.name}: the oldest {dropped} turn{'s' * (dropped > 1)} no longer fit the "
                        f"model's {self.context}-token context; they stay on screen but are not sent")
            await self.show_context_mark()

    @work(group="generate")
    async def _generate(self, reply: Reply, prompt: str) -> None:
        """Stream one reply (into its view, once there is one); every way out leaves the reply in a final
        state, and the first exchange's end titles a session still called `chat N`."""
        try:
            client = await self.link.ready()
            self.follow_engine()  # its model's defaults and template, whichever engine answers now
            self.warmed = self.link.info.pid if self.link.info is not None else None  # it will have the conversation
            self.session.answered_by_engine()
            await self._fit(client, prompt)
            # aclosing: a cancelled reply closes its stream at once, which aborts it in the engine
            label = f"console: {self.session.name}"[:128]  # the owner the ops panels and other consoles show
            params = msgspec.structs.replace(self.session.params, reasoning=True)  # thinking apart, if any
            async with contextlib.aclosing(client.generate(self.session.request(prompt), params, rid=reply.rid,
                                                           client=label,
                                                           template_kwargs=self.session.template_kwargs())) as stream:
                async for out in stream:
                    reply.add(out)
                    if time.monotonic() - self._gauge_at > GAUGE_EVERY and displayed(self):
                        self.show_gauge()  # the context fills as the reply streams (fan-out tabs read 0 till the end)
        except EngineError as e:
            reply.fail("error", e.message)
        except EngineUnavailable as e:
            reply.fail("interrupted", str(e))
        except asyncio.CancelledError:
            if reply.live:
                reply.fail("interrupted", self.link.interruption or "cancelled")
            raise
        except Exception as e:  # whatever else goes wrong ends this reply, not the app
            reply.fail("error", f"{type(e).__name__}: {e}")
        finally:
            if (view := self._view_of(reply)) is not None:
                await view.finish_streaming()
            self.session.auto_title()  # the app relabels the tab on StateChanged
            self.post_message(self.StateChanged(self))
            if not self.closing:  # the reply ended (also aborted or interrupted): the next message may go
                self.show_settings()
                self.call_later(self._send_pending)

    async def abort(self) -> bool:
        """Ask the engine to stop this session's reply; the stream then ends with an aborted Final."""
        reply = self.session.live
        if reply is None:
            return False
        if reply.state == "queued" or await self.link.abort(reply.rid) == "unreachable":
            # not streaming yet, or the engine is gone: end it here (closing the stream also tells
            # the engine, if it has the request)
            self.interrupt("aborted")
        return True

    async def stop_streaming(self) -> None:
        """Cancel the stream and wait until it has wound down, before this pane's widgets go away
        (a reply torn down mid-render leaves asyncio complaining on stderr). Queued messages stay unsent."""
        self.closing = True
        for worker in [*self.workers.cancel_group(self, "generate"), *self.workers.cancel_group(self, "warm")]:
            with contextlib.suppress(WorkerCancelled, WorkerFailed):
                await worker.wait()

    def interrupt(self, state: str, why: str = "") -> None:
        """End the live reply here as `state` (aborted, or interrupted when the engine is lost); the
        text so far stays, and closing the stream tells the engine to stop too."""
        reply = self.session.live
        if reply is not None:
            reply.fail(state, why)
            self.workers.cancel_group(self, "generate")
