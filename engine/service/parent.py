"""An engine started by the launcher (`engine/service/launcher.py`) lives no longer than the process
that started it: the console, `minichat serve --http`, `bench`, a test. It runs in a session of its own
(so a Ctrl-C meant for its starter does not reach it mid-step), which also means nothing kills it when
its starter is SIGKILLed; it would keep the address, the model and the KV memory with nobody to stop it.
So the launcher names itself in MINICHAT_PARENT_PID, and the engine watches that process through a
pidfd (readable once it exits), polled with its sockets. An engine started by hand has no such parent
and runs until it is stopped.
"""

from __future__ import annotations

import os

PARENT_ENV = "MINICHAT_PARENT_PID"


def parent_pidfd() -> int | None:
    """A pidfd of the launching process, or None when nothing launched this engine. If that process is
    already gone (this engine was reparented), a pidfd that is readable at once stands for it."""
    value = os.environ.get(PARENT_ENV)
    if not value or not value.isdigit():
        return None
    parent = int(value)
    if os.getppid() != parent:  # reparented: the launcher died before the engine got here
        read, write = os.pipe()
        os.close(write)  # a pipe whose writer is closed reads as EOF: readable at once
        return read
    try:
        return os.pidfd_open(parent)
    except ProcessLookupError:  # it exited in between
        read, write = os.pipe()
        os.close(write)
        return read
