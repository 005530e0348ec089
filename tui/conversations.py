"""The app's side of the store: whether conversations are being saved, and what to do when not; and
their export as Markdown.

The database is optional to the console: a StoreError closes it, is told once through `notify`
(the app's), and from then on nothing is saved and `problem` says why. The app never handles a
StoreError itself.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from tui.session import Session
from tui.store import DB_NAME, Store, StoreError, data_dir


class Conversations:
    """The conversations at `path` (default: conversations.sqlite3 in `data_dir()`)."""

    def __init__(self, notify: Callable[..., object], path: Path | None = None) -> None:
        self.notify = notify
        self.path = path or data_dir() / DB_NAME
        self.store: Store | None = None
        self.problem = ""
        self._numbered = 0  # new chats are numbered after the saved ones

    def open(self) -> list[Session]:
        """Open the database; the sessions that were in tabs when the console last ran, oldest first (but
        those another running console has open, and those too damaged to read, which are said)."""
        try:
            self.store = Store(self.path)
            uids = self.store.open_uids()
            self._numbered = len(self.store.sessions())
        except StoreError as e:
            self.failed(e)
            return []
        sessions = [s for s in map(self.load, uids) if s is not None]
        return sessions

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def failed(self, e: StoreError) -> None:
        """Go on without saving, and say so once (the status line keeps saying it)."""
        self.close()
        self.store, self.problem = None, str(e)
        self.notify(str(e), title="conversations", severity="error", timeout=20)

    def new_name(self, name: str | None = None) -> str:
        """`name`, or else `chat N`; every new chat takes a number, named or not."""
        self._numbered += 1
        return name or f"chat {self._numbered}"

    def save(self, session: Session, is_open: bool = True) -> None:
        """Store the session (once it has something worth keeping; a fan-out's scratch tab only once kept)."""
        if self.store is not None and session.turns and session.group is None:
            try:
                self.store.save(session, is_open)
            except StoreError as e:
                self.failed(e)

    def unsaved(self, sessions: Iterable[Session]) -> list[Session]:
        """Those of `sessions` that would be lost on closing: all with turns (but a fan-out's scratch tabs,
        never saved), while nothing is saved."""
        return [] if self.store is not None else [s for s in sessions if s.turns and s.group is None]

    def load(self, uid: str) -> Session | None:
        """A saved session to write to, or None if it cannot be read (said, but saving goes on: it may
        just be gone). One another running console has open comes as a copy of its own, so neither
        console's turns overwrite the other's; what reading skipped is said."""
        if self.store is None:
            return None
        try:
            session = self.store.load(uid)
            if not self.store.claim(uid):
                session = dataclasses.replace(session, uid=uuid.uuid4().hex, name=f"{session.name} (copy)")
                self.notify(f"{session.name}: the original is open in another console; this is a copy",
                            title="conversations", severity="warning", timeout=10)
        except StoreError as e:
            self.notify(str(e), severity="error")
            return None
        finally:
            for problem in self.store.problems:
                self.notify(problem, title="conversations", severity="warning", timeout=10)
            self.store.problems.clear()
        return session

    def export(self, session: Session, path: str = "") -> None:
        """Write the conversation as Markdown (to `path`, default a file named after it in the data directory)
        and say where, or why not."""
        slug = "".join(c if c.isalnum() else "-" for c in session.name.lower()).strip("-") or "chat"
        target = Path(path).expanduser() if path else data_dir() / "exports" / f"{slug}.md"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(session.to_markdown(), encoding="utf-8")
        except OSError as e:
            self.notify(f"could not export {session.name!r}: {e}", severity="error")
            return
        self.notify(f"exported {session.name!r} to {target}", title="export")

    def delete(self, uid: str) -> None:
        if self.store is not None:
            try:
                self.store.delete(uid)
            except StoreError as e:
                self.failed(e)
