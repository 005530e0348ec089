"""The minichat app: chat sessions in tabs beside live ops panels, over one link to an engine.

The app owns layout and keys, and wires the commands tui/commands.py lists to what carries them
out (`command_handlers`); sessions stream their own replies (tui/chat.py) in tabs (tui/tabs.py), panels
draw stats snapshots (tui/panels/), the status line sums them up (tui/statusline.py), the link finds,
watches and re-finds the engine (tui/link.py), and tui/conversations.py keeps conversations across
restarts (tui/store.py). Nothing the engine or the database does or fails to do is allowed to end the app.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import ClassVar

from textual.app import App, ComposeResult, ScreenStackError, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.events import Resize
from textual.reactive import reactive
from textual.screen import Screen
from textual.theme import ThemeProvider
from textual.widget import Widget
from textual.widgets import Footer, TabbedContent, Tabs

from engine.service.protocol import Stats
from tui.chat import ChatPane, PromptInput
from tui.commands import BY_NAME, COMMANDS, Command, parse_compare, parse_fanout, parse_number, parse_slash
from tui.conversations import Conversations
from tui.dialogs import AskScreen, ConfirmScreen
from tui.fleet import WATCH_EVERY, EngineReplica, Fleet
from tui.help import HelpScreen
from tui.link import STATS_EVERY, EngineLink, LinkState
from tui.palette import Palette
from tui.panels import PANELS, OpsPanels, RequestTable
from tui.panels.detail import RequestDetailScreen
from tui.panels.fleet import FleetChoice, FleetScreen
from tui.picker import ModelsScreen
from tui.session import SETTINGS, Session
from tui.sessions import Choice, SessionsScreen
from tui.shelf import ModelShelf
from tui.statusline import StatusLine
from tui.tablist import TabsScreen
from tui.tabs import SessionTabs, tab_id

WIDE = 120  # columns from which the ops panels open beside the chat (below, one side at a time)
OPS_STEP = 10  # percent of the width that f7 / f8 move the split by
TEXTUAL_DUPLICATES = {"Keys"}  # Textual's palette entries that minichat's own replace (its help: f1)


class MinichatApp(App[None]):
    """Many concurrent chat sessions and the scheduler that serves them, in one terminal.

    Every key below is one that terminals and tmux pass through unchanged (function keys, ctrl+letter,
    escape, page keys); alt+digit and alt+enter are not among them. The footer's labels are one word, so
    that all of them fit 80 columns; the help screen (f1) says each in full (the tooltip).
    """

    CSS_PATH = "app.tcss"
    TITLE = "minichat"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f1", "help", "Help"),
        Binding("ctrl+n", "new_session", "New", tooltip="New chat"),
        Binding("ctrl+o", "list_sessions", "Saved", tooltip="Saved conversations: search, reopen, export"),
        Binding("ctrl+w", "close_session", "Close chat", priority=True, show=False),
        Binding("f2", "command('rename')", "Rename chat", show=False),
        Binding("ctrl+f", "command('fanout')", "Fan out", show=False),
        Binding("ctrl+g", "close_group", "Close this tab's fan-out group (all its tabs)", show=False),
        Binding("ctrl+r", "command('regen')", "Regenerate the last reply", show=False),
        Binding("ctrl+t", "list_tabs", "Open tabs; then 1…9 goes to that tab", show=False),
        Binding("escape", "abort", "Stop", tooltip="Stop the reply (with none streaming: stop editing)"),
        Binding("ctrl+pagedown", "switch_session(1)", "Next chat", show=False),
        Binding("ctrl+pageup", "switch_session(-1)", "Previous chat", show=False),
        Binding("f3", "toggle_thinking", "Show/hide thinking", show=False),
        Binding("f4", "fleet", "Fleet"),
        Binding("f9", "command('model')", "Models: the catalogue's, for this chat (--models-dir)", show=False),
        Binding("f5", "cycle_layout", "Layout", tooltip="Chat, split or ops panels: the next of the three views"),
        # priority: the prompt box (a TextArea) would take f6 and f7 for selecting text
        Binding("f6", "switch_focus", "Next panel: the prompt box, then each ops table", show=False, priority=True),
        Binding("f7", f"resize_ops({-OPS_STEP})", "Ops panels narrower", show=False, priority=True),
        Binding("f8", f"resize_ops({OPS_STEP})", "Ops panels wider", show=False, priority=True),
    ]

    ops_width: reactive[int] = reactive(0, init=False)
    """Percent of the width given to the ops panels: 0 hides them, 100 hides the chat."""

    def __init__(self, link: EngineLink, store_path: Path | None = None, fleet: Fleet | None = None,
                 models: ModelShelf | None = None) -> None:
        """`store_path`: the conversation database (default: conversations.sqlite3 in `data_dir()`). `fleet`:
        replicas to watch (`--engines`); `link` may be one of theirs."""
        super().__init__()
        self.link = link
        self.models = models  # a catalogue of models (--models-dir): each chat picks one
        self.fleet = fleet
        for watched in [link, *(r.link for r in fleet.engines if r.link is not link)] if fleet else [link]:
            self.wire(watched)
        self.conversations = Conversations(self.notify, store_path)
        self.last_stats: Stats | None = None
        self.stats_at = 0.0  # monotonic time of the last snapshot
        self._ops_restore = 50
        self._restoring = False  # reopening the last run's tabs (on_mount)
        self._fan_outs = 0  # fan-outs so far: each names its group of tabs
        self._collapsed = False  # a split that a narrow terminal turned into one side
        self._followed: dict[int, object] = {}  # id(link) -> the engine (pid, model, context) its chat tabs follow

    # -- layout -----------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield StatusLine(id="status")
        with Horizontal(id="main"):
            yield SessionTabs(self.replica_of, id="chats")
            yield OpsPanels(self.link, id="ops")
        yield Footer()

    async def on_mount(self) -> None:
        wide = self.size.width >= WIDE
        self._ops_restore = 50 if wide else 100
        self.set_reactive(MinichatApp.ops_width, 50 if wide else 0)
        self.watch_ops_width(self.ops_width)
        if self.fleet is None or self.fleet.number(self.link) is None:
            self.run_worker(self.link.run(), name="engine link")
        if self.fleet is not None:
            self.run_worker(self.fleet.run(), name="fleet")
        reopened = self.conversations.open()  # the tabs that were open when the console last ran
        self._restoring = True  # each tab is in front for a moment as it is added: none says its notices then
        for session in reopened:
            await self.open_session(session, activate=session is reopened[-1])
        self._restoring = False
        if (front := self.current) is not None:
            front.say_other_model()
        if not reopened:
            await self.new_session()
        self.show_status()
        self.set_interval(0.5, self.show_status)  # the age of stale stats counts up
        if self.fleet is not None and len(self.fleet.replicas) > 1:
            self.action_fleet()

    async def on_unmount(self) -> None:
        await self.link.close()
        if self.fleet is not None:
            await self.fleet.close()
        self.conversations.close()

    @property
    def tabs(self) -> SessionTabs:
        return self.query_one("#chats", SessionTabs)

    @property
    def ops(self) -> OpsPanels:
        return self.query_one("#ops", OpsPanels)

    @property
    def current(self) -> ChatPane | None:
        """The session in the active tab."""
        return self.tabs.front

    def watch_ops_width(self, width: int) -> None:
        self.ops.display = width > 0
        self.tabs.display = width < 100
        if self.tabs.display and (pane := self.current) is not None:
            pane.wake()  # back from full-width ops panels
        self.ops.styles.width = f"{width}%" if width < 100 else "1fr"
        focused = self.focused
        if focused is None or not all(node.display for node in focused.ancestors_with_self if isinstance(node, Widget)):
            self.focus_side(ops=not self.tabs.display)

    def focus_side(self, ops: bool) -> None:
        """Focus the running set (ops) or the prompt box (chat), or the other one if that side is hidden."""
        tables = [t for t in self.ops.query(RequestTable) if t.display] if self.ops.display else []
        ops_target = tables[-1] if tables else self.ops if self.ops.display else None
        chat = self.current if self.tabs.display else None
        if ops and ops_target is not None:
            ops_target.focus()
        elif chat is not None:
            chat.focus_input()
        elif ops_target is not None:
            ops_target.focus()

    def show_status(self) -> None:
        # query_one, not query: a query walks every widget of every tab, a few times a second
        if (line := self.query_one_optional("#status", StatusLine)) is not None:  # none while the app is closing
            line.show(self.link.state, self.last_stats, self.stats_at, self.fleet, self.conversations.problem)

    # -- engine -----------------------------------------------------------------------------------
    def on_engine_stats(self, stats: Stats) -> None:
        """A snapshot (four a second, also while the engine idles): the panels and the status line draw
        what changed in it, which is nothing at all while nothing moves. The chat tabs take no part."""
        self.last_stats, self.stats_at = stats, time.monotonic()
        with self.while_open():
            self.ops.show_stats(stats, self.link.names)  # draws only what is shown; keeps the history
            self.show_status()

    def on_engine_state(self, state: LinkState) -> None:
        with self.while_open():
            self.show_status()
            self.chats_follow(self.link, state)
            if not state.connected:
                self.ops.forget()  # its requests are gone with it: none is offered to abort
            if state.kind == "lost":
                self.notify(state.detail, title="engine lost", severity="warning")
            elif state.kind == "failed":
                self.notify(state.detail, title="engine", severity="error", timeout=15)

    def on_replica_state(self, link: EngineLink, state: LinkState) -> None:
        """An engine of the fleet that the console does not show: only the chats pinned to it care."""
        with self.while_open():
            if self.chats_follow(link, state) and state.kind in ("lost", "failed"):
                self.notify(state.detail, title=f"replica {link.address}", severity="warning")

    def chats_follow(self, link: EngineLink, state: LinkState) -> list[ChatPane]:
        """The chats on `link` learn its model (its name, context, sampling defaults and chat template; once
        per engine) and have their replies interrupted when it is lost; returns them."""
        panes = [pane for pane in self.query(ChatPane) if pane.link is link]
        info = link.info
        engine = (info.pid, info.model, info.max_seq_len) if info is not None else None
        if state.connected and engine != self._followed.get(id(link)):
            self._followed[id(link)] = engine
            for pane in panes:
                pane.follow_engine()
            if (front := self.current) in panes and not self._restoring:
                front.say_other_model()  # the chat in front says so now; the others when they are opened
        if state.kind == "lost":
            for pane in panes:
                pane.interrupt("interrupted", state.cause)
        return panes

    def wire(self, link: EngineLink) -> None:
        """The engine the console shows feeds the status line and the ops panels, four snapshots a second;
        the fleet's other engines are read once a second, and their state matters only to chats pinned there."""
        if link is self.link:
            link.on_stats, link.on_state, link.stats_every = self.on_engine_stats, self.on_engine_state, STATS_EVERY
        else:
            link.on_stats, link.stats_every = lambda stats: None, WATCH_EVERY
            link.on_state = partial(self.on_replica_state, link)

    @contextmanager
    def while_open(self) -> Iterator[None]:
        """The link calls back at any time, also while the app is closing and its widgets are gone."""
        try:
            yield
        except (NoMatches, ScreenStackError):
            if self.is_running:
                raise

    # -- sessions ---------------------------------------------------------------------------------
    async def new_session(self, name: str | None = None, activate: bool = True,
                          like: Session | None = None) -> ChatPane:
        """Open a session in a new tab, with `like`'s system prompt and sampling settings if given (without a
        name it is `chat N` until its first exchange gives it a title)."""
        session = Session(self.conversations.new_name(name), titled=name is not None)
        if like is not None:
            session.system_prompt, session.chosen = like.system_prompt, dict(like.chosen)
        return await self.open_session(session, activate)

    async def open_session(self, session: Session, activate: bool = True) -> ChatPane:
        """Show `session` in a tab (the one it has, if it is open already)."""
        pane = self.tabs.pane_of(session.uid)
        if pane is None:
            kept = self.models.catalogue.find(session.model) if self.models and session.model else None
            pane = ChatPane(session, self.model_link(kept.id) if kept is not None else self.link)
            await self.tabs.add(pane)
        if activate:
            self.tabs.bring_to_front(pane)
        return pane

    def on_chat_pane_state_changed(self, event: ChatPane.StateChanged) -> None:
        self.tabs.label(event.pane)
        event.pane.session.updated = time.time()
        self.conversations.save(event.pane.session)

    def replica_of(self, link: EngineLink) -> int | str | None:
        """The fleet's number for the engine a chat talks to, when the fleet has engines to choose from; with a
        catalogue, the model's id."""
        if self.models is not None:
            return self.models.model_of(link)
        return self.fleet.number(link) if self.fleet is not None and len(self.fleet.engines) > 1 else None

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        if (pane := self.current) is not None and self.tabs.display:
            pane.focus_input()
            pane.wake()
            if not self._restoring:
                pane.say_other_model()

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        pane = event.prompt_input.query_ancestor(ChatPane)
        text = event.text
        if text.startswith("/") and not text.startswith("//"):
            try:
                command, arg = parse_slash(text)
            except ValueError as e:
                self.notify(str(e), severity="error")
                return
            await self.run_command(command, arg, pane)
        elif pane.editing is not None:
            try:
                await pane.resend(pane.editing, text.removeprefix("/"))
            except ValueError as e:
                self.notify(str(e), severity="error")
        else:
            await pane.send(text.removeprefix("/"))

    async def on_prompt_input_edit_last(self, event: PromptInput.EditLast) -> None:
        pane = event.prompt_input.query_ancestor(ChatPane)
        if pane.session.turns:
            await self.run_command(BY_NAME["edit"], "", pane)

    # -- commands (tui/commands.py) ------------------------------------------------------------------
    def command_handlers(self, pane: ChatPane) -> dict[str, Callable[[str], object]]:
        """What each command does when typed in `pane`'s prompt box (or run on the front tab from the palette
        or a key), given what was typed after its name (commands without an argument ignore it); a ValueError
        is told to the person. Most change only the pane's session; the rest act on the tabs, the saved
        conversations, the fleet or the engine."""
        return {
            "new": self.action_new_session,
            "close": lambda _: self.action_close_session(),
            "tab": self.go_to_tab,
            "tabs": lambda _: self.action_list_tabs(),
            "rename": pane.session.rename,
            "sessions": self.action_list_sessions,
            "export": partial(self.conversations.export, pane.session),
            "regen": lambda _: pane.regenerate(),
            "edit": pane.edit,
            "copy": pane.copy_reply,
            "clear": lambda _: pane.clear(),
            "system": pane.set_system_prompt,
            "think": pane.session.set_thinking,
            **{name: partial(pane.set_setting, name) for name in SETTINGS},
            "reset": lambda _: pane.reset(),
            "fanout": lambda prompts: self.fan_out(parse_fanout(prompts), like=pane.session),
            "keep": lambda _: pane.keep(),
            "closegroup": lambda _: self.action_close_group(),
            "abort": lambda _: self.action_abort(),
            "engine": partial(self.pin_to, pane),
            "model": partial(self.pick_model, pane),
            "compare": lambda arg: self.compare(*parse_compare(arg), like=pane.session),
            "reconnect": lambda _: self.notify(self.link.retry(), title="reconnect"),
            "help": lambda _: self.action_help(),
        }

    async def run_command(self, command: Command, arg: str, pane: ChatPane | None = None) -> None:
        """Carry out a command on `pane` (the current session by default); then the pane shows what it changed
        (settings line, tab label) and the session is saved."""
        pane = pane or self.current
        if pane is None:
            return
        try:
            done = self.command_handlers(pane)[command.name](arg)
            if inspect.isawaitable(done):
                await done
        except ValueError as e:
            self.notify(str(e), severity="error")
        pane.show_settings()
        self.tabs.label(pane)
        pane.session.updated = time.time()
        self.conversations.save(pane.session)

    async def action_command(self, name: str) -> None:
        """A command from the palette or a key (f2, ctrl+f, ctrl+r), on the front tab: its argument is asked for
        first in a dialog, where it takes one (`Command.asks`)."""
        command = BY_NAME[name]
        if not command.asks:
            await self.run_command(command, "")
            return

        async def answered(arg: str | None) -> None:
            if arg is not None:
                await self.run_command(command, arg)

        pane = self.current
        question = f"{command.title} ({command.arg}): {command.help}"
        self.push_screen(AskScreen(question, pane.present_value(name) if pane is not None else "", select=True),
                         answered)

    def action_command_palette(self) -> None:
        """Textual's palette, with a search box that applies keys in the order typed (tui/palette.py)."""
        if self.use_command_palette and not Palette.is_open(self):  # type: ignore[arg-type]  # stub wants App[object]
            self.push_screen(Palette(id="--command-palette"))

    def search_themes(self) -> None:
        """The palette's "Theme" command: the same in-order search box, over the themes."""
        self.push_screen(Palette(providers=[ThemeProvider], placeholder="Search for themes…"))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Textual's own entries but those minichat has its own of (its "Keys" panel: minichat's help),
        then minichat's."""
        for entry in super().get_system_commands(screen):
            if entry.title == "Quit":
                yield SystemCommand("Quit", "Quit minichat (asks while replies stream) (ctrl+q)", self.action_quit)
            elif entry.title not in TEXTUAL_DUPLICATES:
                yield entry
        for command in COMMANDS:
            yield SystemCommand(command.title, command.help, partial(self.action_command, command.name))
        yield SystemCommand("Layout: chat, split or ops panels", "the next of the three views (f5)",
                            self.action_cycle_layout)
        for i, (panel_id, title) in enumerate(PANELS, 1):
            yield SystemCommand(f"Show/hide panel: {title}", f"key {i} in the ops panels",
                                partial(self.action_toggle_panel, panel_id))

    # -- the session list -----------------------------------------------------------------------------
    def action_list_sessions(self, search: str = "") -> None:
        if (store := self.conversations.store) is None:
            self.notify(self.conversations.problem or "conversations are not saved", severity="error")
            return
        self.push_screen(SessionsScreen(store, search), self.on_session_chosen)

    async def on_session_chosen(self, choice: Choice | None) -> None:
        """Open, export, rename or delete the conversation chosen in the list, whether or not it is in a tab."""
        if choice is None or self.conversations.store is None:
            return
        action, uid = choice
        open_pane = self.tabs.pane_of(uid)
        session = open_pane.session if open_pane is not None else self.conversations.load(uid)
        if session is None:
            return
        if action == "open":
            await self.open_session(session)
            self.conversations.save(session)
        elif action == "export":
            self.conversations.export(session)
        elif action == "rename":
            self.rename_saved(session, open_pane)
        elif action == "delete":
            self.delete_saved(uid, session, open_pane)

    def rename_saved(self, session: Session, open_pane: ChatPane | None) -> None:
        """Ask for a new name for a saved conversation, then show the list again."""
        async def renamed(name: str | None) -> None:
            if name and name.strip():
                session.rename(name.strip())
                if open_pane is not None:
                    self.tabs.label(open_pane)
                self.conversations.save(session, is_open=open_pane is not None)
            self.action_list_sessions()

        self.push_screen(AskScreen(f"Rename {session.name!r} to:", session.name, select=True), renamed)

    def delete_saved(self, uid: str, session: Session, open_pane: ChatPane | None) -> None:
        """Delete saved conversation `uid` (closing its tab) once confirmed, then show the list again."""
        async def delete(yes: bool | None) -> None:
            if yes and self.conversations.store is not None:
                if open_pane is not None:
                    await self.close_pane(open_pane, forget=True)
                self.conversations.delete(uid)
            self.action_list_sessions()

        turns = len(session.turns)
        self.push_screen(ConfirmScreen(f"Delete {session.name!r} and its {turns} turn{'' if turns == 1 else 's'} for "
                                       f"good?"),
                         delete)

    # -- actions ----------------------------------------------------------------------------------
    async def action_quit(self) -> None:
        """Quit, after asking if replies are still streaming (the engine aborts them) or conversations
        would be lost (the database is unusable)."""
        streaming = [p for p in self.query(ChatPane) if p.session.live is not None]
        unsaved = self.conversations.unsaved(p.session for p in self.query(ChatPane))
        if not streaming and not unsaved:
            await self.quit_now()
            return
        why = []
        if streaming:
            why.append(f"{len(streaming)} repl{'ies are' if len(streaming) > 1 else 'y is'} still streaming")
        if unsaved:
            why.append(f"{len(unsaved)} conversation{'s are' if len(unsaved) > 1 else ' is'} not saved")

        async def quit_if(yes: bool | None) -> None:
            if yes:
                await self.quit_now()

        self.push_screen(ConfirmScreen(f"Quit minichat? {' and '.join(why).capitalize()}."), quit_if)

    async def quit_now(self) -> None:
        """Wind down the replies still streaming (the engine aborts them) and save, then exit: with status 1
        while the engine link is failed (an engine that did not start: a script or a shell sees it failed)."""
        for pane in self.query(ChatPane):
            await pane.stop_streaming()
            self.conversations.save(pane.session)
        self.exit(return_code=1 if self.link.state.kind == "failed" else 0)

    async def action_new_session(self, name: str = "") -> None:
        """ctrl+n, or `/new name`."""
        await self.new_session(name or None)

    async def close_pane(self, pane: ChatPane, forget: bool = False) -> None:
        """Close a session's tab (stopping its reply); it stays in the store unless `forget`."""
        await pane.stop_streaming()
        if not forget:
            self.conversations.save(pane.session, is_open=False)
        await self.tabs.close(pane)
        if self.current is None:
            await self.new_session()
        else:
            self.current.focus_input()

    def action_close_session(self) -> None:
        pane = self.current
        if pane is None:
            return

        async def close(yes: bool | None = True) -> None:
            if yes:
                await self.close_pane(pane)

        if pane.session.live is not None:
            self.push_screen(ConfirmScreen(f"Close {pane.session.name!r} and stop its reply?"), close)
        elif self.conversations.unsaved([pane.session]):
            self.push_screen(ConfirmScreen(f"Close {pane.session.name!r}? It is not saved: its conversation is "
                                           f"lost."), close)
        else:
            self.run_worker(close())

    def action_toggle_thinking(self) -> None:
        """f3: fold or unfold the thinking of the front session's replies."""
        if (pane := self.current) is not None:
            pane.toggle_thinking()

    async def action_abort(self) -> None:
        """Stop the reply; with none streaming, stop editing a message."""
        pane = self.current
        if pane is None or (pane.session.live is None and pane.cancel_edit()):
            return
        if not await pane.abort():
            self.notify("nothing to stop in this session")

    async def fan_out(self, prompts: list[str], like: Session) -> None:
        """Open one tab per prompt (with `like`'s settings) to watch them batch in the ops panels."""
        await self._open_group("fan", [(str(i), self.link, prompt) for i, prompt in enumerate(prompts, 1)], like)
        if not self.ops_width and self.size.width >= WIDE:
            self.ops_width = self._ops_restore if self._ops_restore < 100 else 50

    async def _open_group(self, kind: str, tabs: list[tuple[str, EngineLink, str]], like: Session) -> None:
        """One tab per (name, engine link, prompt), with `like`'s settings, each sending its prompt at once.

        Every request goes out before any tab is drawn: drawing a tab takes a while (dozens, seconds),
        and requests sent as their tabs were drawn trickled in and never filled the waiting queue. The
        tabs are a group of scratch sessions, closed together (ctrl+g) and never saved unless kept."""
        self._fan_outs += 1
        group = f"{kind} {self._fan_outs}"
        panes = []
        for name, link, prompt in tabs:
            pane = ChatPane(Session(f"{group}.{name}", like.system_prompt, dict(like.chosen), titled=True, group=group),
                            link)
            pane.start(prompt)
            panes.append(pane)
        await self.tabs.add(*panes)
        self.tabs.bring_to_front(panes[0])

    async def action_close_group(self) -> None:
        """Close every tab of the front tab's fan-out at once, stopping their replies (scratch: none is saved)."""
        pane = self.current
        if pane is None or pane.session.group is None:
            self.notify("this tab is not part of a fan-out (ctrl+f makes one); ctrl+w closes it")
            return
        every = self.tabs.panes
        panes = [p for p in every if p.session.group == pane.session.group]
        # the tab nearest the front one that stays comes to the front first: a removed front tab would
        # hand the front to its neighbour, which may be going too
        here = every.index(pane)
        stays = sorted((p for p in every if p not in panes), key=lambda p: abs(every.index(p) - here))
        survivor = stays[0] if stays else await self.new_session(activate=False)
        self.tabs.active = tab_id(survivor.session)
        await asyncio.gather(*[p.stop_streaming() for p in panes])
        await self.tabs.close(*panes)
        survivor.focus_input()
        self.notify(f"closed the {len(panes)} tabs of {pane.session.group}")

    def action_list_tabs(self) -> None:
        """The open tabs, numbered; a digit (or enter) brings one to the front."""
        panes = self.tabs.panes

        def chosen(index: int | None) -> None:
            if index is not None:
                try:
                    self.tabs.go_to(index)
                except ValueError as e:
                    self.notify(str(e), severity="error")

        current = next((i for i, p in enumerate(panes) if p is self.current), 0)
        self.push_screen(TabsScreen([p.session for p in panes], current), chosen)

    def go_to_tab(self, number: str) -> None:
        """/tab N: bring the Nth tab to the front."""
        if (n := parse_number(number, "/tab")) is None:
            raise ValueError("/tab takes the tab's number, e.g. /tab 3 (ctrl+t lists them)")
        self.tabs.go_to(n - 1)

    def action_switch_session(self, step: int) -> None:
        tabs = self.tabs.query_one(Tabs)
        if step > 0:
            tabs.action_next_tab()
        else:
            tabs.action_previous_tab()

    def action_cycle_layout(self) -> None:
        """f5: split -> chat -> ops panels -> split. Below WIDE columns, where a split would leave both
        sides cramped, chat <-> ops panels. Every view with the chat in it puts the typing in its prompt box
        (the ops panels alone, in the running set): a table that kept focus took `/max_tokens 800` as a
        filter and sent nothing."""
        if 0 < self.ops_width < 100:
            self._ops_restore, self.ops_width = self.ops_width, 0
        elif self.ops_width == 0:
            self.ops_width = 100
        else:
            split = self._ops_restore if self._ops_restore < 100 else 50
            self.ops_width = split if self.size.width >= WIDE else 0
        self.focus_side(ops=self.ops_width == 100)

    def type_in_prompt(self, text: str) -> None:
        """Text typed where it means nothing (an ops table, which takes only its keys): it goes to the prompt
        box, bringing the chat back if the ops panels fill the screen, rather than nowhere."""
        if self.ops_width == 100:
            split = self._ops_restore if self._ops_restore < 100 else 50
            self.ops_width = split if self.size.width >= WIDE else 0
        if (pane := self.current) is not None:
            box = pane.query_one(PromptInput)
            box.focus()
            box.insert(text)

    def on_resize(self, event: Resize) -> None:
        """Shrunk below WIDE columns, a split keeps the side that has focus; grown back, the split returns."""
        if event.size.width < WIDE and 0 < self.ops_width < 100:
            self._ops_restore, self._collapsed = self.ops_width, True
            in_ops = self.focused is not None and self.ops in self.focused.ancestors_with_self
            self.ops_width = 100 if in_ops else 0
        elif event.size.width >= WIDE and self._collapsed:
            self._collapsed = False
            if self.ops_width in (0, 100):
                self.ops_width = self._ops_restore

    def action_resize_ops(self, delta: int) -> None:
        self.ops_width = min(100, max(OPS_STEP * 2, (self.ops_width or self._ops_restore) + delta))

    def action_toggle_panel(self, panel_id: str) -> None:
        if not self.ops_width:
            self.ops_width = self._ops_restore
        in_ops = self.focused is not None and self.ops in self.focused.ancestors_with_self
        self.ops.toggle(panel_id)
        if in_ops:  # the focused table may have just been hidden: stay in the panels
            self.focus_side(ops=True)
        if self.last_stats is not None:
            self.ops.show_stats(self.last_stats, self.link.names)

    def on_ops_panels_typed(self, event: OpsPanels.Typed) -> None:
        self.type_in_prompt(event.text)

    # -- the fleet --------------------------------------------------------------------------------
    def action_fleet(self) -> None:
        """f4: the fleet view; without --engines there is none, and f4 says how to get one."""
        if self.fleet is None:
            self.notify("no fleet to show: start the console with --engines ADDR1,ADDR2,... (engines' ZeroMQ "
                        "addresses, HTTP replicas' URLs) to watch several replicas here", title="f4 · fleet")
        elif not isinstance(self.screen, FleetScreen):
            self.push_screen(FleetScreen(self.fleet, self.link), self.on_fleet_choice)

    async def on_fleet_choice(self, choice: FleetChoice | None) -> None:
        if choice is None:
            return
        action, replica = choice
        if action == "ops":
            await self.show_engine(replica.link)
        else:
            self.pin(await self.new_session(), replica)

    async def show_engine(self, link: EngineLink) -> None:
        """Enter on a fleet row: the status line, the ops panels and new chats turn to `link`'s engine (open
        chats stay where they are); the panels start afresh, with the same ones shown."""
        if link is not self.link:
            old, self.link = self.link, link
            self.wire(old)  # no snapshot of either reaches the panels while they are swapped
            hidden = [panel_id for panel_id, _ in PANELS if not self.ops.query_one(f"#{panel_id}").display]
            await self.ops.remove()
            ops = OpsPanels(link, id="ops")
            await self.query_one("#main", Horizontal).mount(ops)
            for panel_id in hidden:
                ops.toggle(panel_id)
            self.watch_ops_width(self.ops_width)
            self.last_stats, self.stats_at = link.stats, link.stats_at
            if link.stats is not None:
                ops.show_stats(link.stats, link.names)
            self.wire(link)
        if not self.ops_width:
            self.ops_width = self._ops_restore if self.size.width >= WIDE else 100
        self.focus_side(ops=True)
        self.show_status()

    def pin_to(self, pane: ChatPane, number: str) -> None:
        """/engine N: send this chat's next messages to replica N of the fleet; without N, say where they go."""
        replicas = self.fleet.replicas if self.fleet is not None else []
        if not any(isinstance(r, EngineReplica) for r in replicas):
            raise ValueError("/engine pins a chat to one engine of a fleet: start the console with "
                             "--engines ADDR1,ADDR2,... (ZeroMQ addresses)")
        n = parse_number(number, "/engine")
        if n is None:
            self.notify(f"{pane.session.name!r} talks to {pane.link.address}; /engine N moves it to replica N (f4 "
                        f"lists them)")
            return
        if not 1 <= n <= len(replicas):
            raise ValueError(f"there is no replica {n}: the fleet has {len(replicas)}")
        replica = replicas[n - 1]
        if not isinstance(replica, EngineReplica):
            raise ValueError(f"replica {n} is an HTTP replica: chats talk to an engine over ZeroMQ; list its "
                             f"engine's address (its `serve --http` --address) in --engines")
        self.pin(pane, replica)

    # -- a catalogue of models (tui/shelf.py) ------------------------------------------------------------
    def model_link(self, model: str) -> EngineLink:
        """The link to `model`'s engine, started (and watched in the fleet view) the first time it is asked for."""
        assert self.models is not None
        link, new = self.models.link(model)
        if new:
            self.wire(link)
            self.run_worker(link.run(), name=f"engine for {model}")
        return link

    def pick_model(self, pane: ChatPane, model: str) -> None:
        """/model NAME (or f9 and a choice): this chat's next messages go to that model's engine."""
        if self.models is None:
            raise ValueError("/model picks among a catalogue of models: start the console with --models-dir DIR or "
                             "--model NAME=PATH, repeated")
        if not model:
            def chosen(choice: str | None) -> None:
                if choice is not None:
                    try:
                        self.pick_model(pane, choice)
                    except ValueError as e:
                        self.notify(str(e), severity="error")

            self.push_screen(ModelsScreen(self.models.rows(), self.models.model_of(pane.link)), chosen)
            return
        replica = self.fleet.engine(self.model_link(model).address) if self.fleet is not None else None
        assert replica is not None  # the shelf adds every model's engine to the fleet
        self.pin(pane, replica)

    async def compare(self, models: list[str], prompt: str, like: Session) -> None:
        """/compare a,b,c PROMPT: one tab per model, each sending the prompt to its model at once (a fan-out group)."""
        if self.models is None:
            raise ValueError("/compare sends a prompt to several models of a catalogue: start the console with "
                             "--models-dir DIR or --model NAME=PATH, repeated")
        ids = [self.models.entry(m).id for m in models]  # every name checked before any engine starts
        await self._open_group("compare", [(model, self.model_link(model), prompt) for model in ids], like)

    def pin(self, pane: ChatPane, replica: EngineReplica) -> None:
        """Send this chat's next messages to `replica`'s engine (not while a reply streams from another)."""
        if pane.link is replica.link:
            return
        if pane.session.live is not None:
            raise ValueError(f"{pane.session.name!r} is streaming a reply from {pane.link.address}: stop it first "
                             f"(escape)")
        pane.link = replica.link
        self.tabs.label(pane)
        pane.follow_engine()  # this engine's model: its context, defaults and template
        self.notify(f"{pane.session.name!r} now talks to {replica.name}")

    # -- focus and help ---------------------------------------------------------------------------
    def action_switch_focus(self) -> None:
        """F6: the next of the prompt box and the ops panels' tables (those shown), round and round."""
        pane = self.current if self.tabs.display else None
        targets = ([pane.query_one(PromptInput)] if pane is not None else []) + \
            (self.ops.focus_targets() if self.ops.display else [])
        if not targets:
            return
        focused = self.focused
        at = next((i for i, t in enumerate(targets) if focused is not None and t in focused.ancestors_with_self), -1)
        targets[(at + 1) % len(targets)].focus()

    def action_help(self) -> None:
        self.push_screen(HelpScreen([("everywhere", App.BINDINGS), ("everywhere", self.BINDINGS),
                                     ("prompt box", PromptInput.BINDINGS),
                                     ("ops panels", OpsPanels.BINDINGS),
                                     ("waiting queue, running set", RequestTable.BINDINGS),
                                     ("request detail (enter on a row)", RequestDetailScreen.BINDINGS),
                                     ("fleet view (f4, with --engines)", FleetScreen.BINDINGS),
                                     ("conversation list (ctrl+o)", SessionsScreen.BINDINGS),
                                     ("tab list (ctrl+t)", TabsScreen.BINDINGS)]))
