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

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Markdown, Static, TextArea
from textual.worker import WorkerCancelled, WorkerFailed

from engine.service.client import EngineError, EngineUnavailable
from tui.names import printable
from tui.panels.base import update_text
from tui.session import Reply, Session, Turn

if TYPE_CHECKING:
    from tui.link import EngineLink


PLACEHOLDER = "Message · enter: send · ctrl+j: new line · /help: commands · f1: keys"
HINT = """\
Type a message and press **enter**; **ctrl+j** starts a new line, and pasted text keeps its lines.
**escape** stops a reply. Settings: `/temperature 0.7`, `/max_tokens 128`, `/system You are terse.`
**ctrl+f** fans a prompt out to several sessions at once; **f5** shows the ops panels to watch them
batch. **f1** lists every key, **ctrl+p** every command.
"""


class PromptInput(TextArea):
    """Multi-line prompt box: Enter sends, ctrl+j (or shift/alt+enter where the terminal reports
    them) starts a new line. Pasted text goes in unchanged, newlines included (TextArea's paste)."""

    BINDINGS = [
        Binding("enter", "send", "Send", priority=True),
        Binding("ctrl+j,shift+enter,alt+enter", "newline", "New line", show=False),
    ]

    class Submitted(Message):
        def __init__(self, prompt_input: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt_input, self.text = prompt_input, text

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, highlight_cursor_line=False, placeholder=PLACEHOLDER, **kwargs)  # type: ignore[arg-type]

    def action_send(self) -> None:
        if self.text.strip():
            self.post_message(self.Submitted(self, self.text))
            self.clear()

    def action_newline(self) -> None:
        self.insert("\n")


class ReplyView(Vertical):
    """An assistant reply: Markdown that grows as text streams in, and a line of numbers under it.

    While the reply streams, the view renders on a clock, not per token: a render re-parses the
    reply's last Markdown block and re-lays-out the screen, and with a few sessions streaming
    hundreds of tokens a second, rendering every token kept the app too busy to answer keys. Each
    frame appends all the text that arrived since the last one, so the text shown is the same, and
    `finish_streaming` appends the rest. A render costs more as the reply grows (a long paragraph
    is re-wrapped whole, a long reply re-laid-out), so frames are spaced by their cost too: twenty
    a second for an ordinary reply, fewer for a very long one.
    """

    FRAME = 1 / 20  # seconds between two renders of the streaming text, at least
    FRAME_COST = 8  # ... and at least this many times as long as an append takes (median of the last few)
    MAX_FRAME = 1.0  # ... but never longer than this
    STREAMING_REFRESH = 0.25  # seconds between two updates of the numbers while tokens stream in

    def __init__(self, reply: Reply) -> None:
        super().__init__(classes="reply")
        self.reply = reply
        self._shown_at = 0.0
        self._markdown: Markdown | None = None  # set while streaming
        self._rendered = len(reply.text)  # characters of reply.text in the Markdown
        self._rendering = asyncio.Lock()
        self._next_frame = 0.0
        self._append_times: deque[float] = deque(maxlen=5)
        self._frames: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Markdown(printable(self.reply.text))
        yield Static(classes="reply-stats")

    def on_mount(self) -> None:
        self.refresh_state()

    def start_streaming(self) -> None:
        """Render the reply's text as it grows, a frame at a time, until `finish_streaming`."""
        self._markdown = self.query_one(Markdown)
        self._frames = self.set_interval(self.FRAME, self._frame)

    async def finish_streaming(self) -> None:
        """Render the text not shown yet, and the reply's final state."""
        if self._frames is not None:
            self._frames.pause()  # a frame that is rendering finishes first (the lock)
        await self._append_new_text()
        if self._frames is not None:
            self._frames.stop()
            self._frames = None
        self._markdown = None
        self.refresh_state()

    async def _frame(self) -> None:
        # a session in a hidden tab (or behind full-width ops panels) catches up once it is shown
        if time.monotonic() >= self._next_frame and all(
                node.display for node in self.ancestors_with_self if isinstance(node, Widget)):
            await self._append_new_text()
            self.refresh_state()

    async def _append_new_text(self) -> None:
        """Append the text that arrived since the last render to the Markdown, as one piece."""
        async with self._rendering:
            text = self.reply.text
            if self._markdown is None or len(text) <= self._rendered:
                return
            new, self._rendered = text[self._rendered:], len(text)
            began = time.monotonic()
            await self._markdown.append(printable(new))
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
        label = "waiting for engine…" if reply.state == "queued" else reply.summary()
        if reply.state == "streaming":
            label += " · streaming…"
        for stats in self.query(".reply-stats").results(Static):  # none while the view is torn down
            update_text(stats, Text(printable(label)))
        for state in ("queued", "streaming", "done", "aborted", "error", "interrupted"):
            self.set_class(reply.state == state, f"-{state}")


class ChatPane(Vertical):
    """The widgets of one Session. The session object outlives the pane's requests and errors."""

    class StateChanged(Message):
        """A reply started or ended, so the tab label and the app's status can follow."""

        def __init__(self, pane: ChatPane) -> None:
            super().__init__()
            self.pane = pane

    def __init__(self, session: Session, link: EngineLink) -> None:
        super().__init__(classes="chat")
        self.session = session
        self.link = link

    def compose(self) -> ComposeResult:
        yield Static(classes="chat-settings")
        with VerticalScroll(classes="chat-log"):
            if not self.session.turns:
                yield Markdown(HINT, classes="chat-hint")
            for turn in self.session.turns:
                yield from self._turn_widgets(turn)
        yield PromptInput(classes="chat-input")

    def on_mount(self) -> None:
        self.query_one(".chat-log", VerticalScroll).anchor()
        self.show_settings()

    def show_settings(self) -> None:
        system = self.session.system_prompt.replace("\n", " ")
        line = f"system: {system}" if system else "no system prompt"
        self.query_one(".chat-settings", Static).update(Text(printable(f"{line}  ·  {self.session.describe()}")))

    def focus_input(self) -> None:
        self.query_one(PromptInput).focus()

    @staticmethod
    def _turn_widgets(turn: Turn) -> tuple[Static, ReplyView]:
        return Static(Text(printable(turn.prompt)), classes="user"), ReplyView(turn.reply)

    async def send(self, prompt: str) -> Reply | None:
        """Start a turn, unless a reply is still generating (one request per session at a time)."""
        if self.session.live is not None:
            self.notify("this session is still generating; press escape to stop it", severity="warning")
            return None
        messages = self.session.messages(prompt)
        turn = self.session.start_turn(prompt)
        user, view = self._turn_widgets(turn)
        await self.query(".chat-hint").remove()
        await self.query_one(".chat-log", VerticalScroll).mount_all([user, view])
        self.link.names.own(turn.reply.rid, f"{self.session.name} #{len(self.session.turns)}")
        self._generate(view, messages)
        self.post_message(self.StateChanged(self))
        return turn.reply

    @work(group="generate")
    async def _generate(self, view: ReplyView, messages: list[dict[str, str]]) -> None:
        """Stream one reply into its view; every way out leaves the reply in a final state."""
        reply = view.reply
        view.start_streaming()  # the view renders the text as it grows, a frame at a time
        try:
            client = await self.link.ready()
            # aclosing: a cancelled reply closes its stream at once, which aborts it in the engine
            async with contextlib.aclosing(client.generate(messages, self.session.params, rid=reply.rid)) as stream:
                async for out in stream:
                    reply.add(out)
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
            await view.finish_streaming()
            self.post_message(self.StateChanged(self))

    async def abort(self) -> bool:
        """Ask the engine to stop this session's reply; the stream then ends with an aborted Final."""
        reply = self.session.live
        if reply is None:
            return False
        if reply.state == "queued" or not await self.link.abort(reply.rid):
            # not streaming yet, or the engine is gone: end it here (closing the stream also tells
            # the engine, if it has the request)
            self.interrupt("aborted")
        return True

    async def stop_streaming(self) -> None:
        """Cancel the stream and wait until it has wound down, before this pane's widgets go away
        (a reply torn down mid-render leaves asyncio complaining on stderr)."""
        for worker in self.workers.cancel_group(self, "generate"):
            with contextlib.suppress(WorkerCancelled, WorkerFailed):
                await worker.wait()

    def interrupt(self, state: str, why: str = "") -> None:
        """End the live reply here as `state` (aborted, or interrupted when the engine is lost); the
        text so far stays, and closing the stream tells the engine to stop too."""
        reply = self.session.live
        if reply is not None:
            reply.fail(state, why)
            self.workers.cancel_group(self, "generate")
