"""The TUI's connection to an engine: find or start it, watch its stats, notice when it goes, come back.

The app never talks to sockets itself; it asks the link for a ready client and receives stats and
state changes through two callbacks. Everything that can go wrong with an engine (not started yet,
failed to start, busy in a long step, killed) becomes a state with a sentence for the status bar,
never an exception in the UI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.config import DEMO_MODEL_DIR, model_id, option_fields
from engine.service.addresses import AddressError, default_address, ipc_listening, log_path, split
from engine.service.client import AsyncEngineClient, EngineError, EngineUnavailable
from engine.service.launcher import EngineHandle, EngineStartError, find, start
from engine.service.protocol import Description, Info, Stats
from tui.names import RequestNames

STALL_AFTER = 2.0  # seconds without a stats snapshot before we check whether the engine is still there
RETRY_EVERY = 1.0  # seconds between attempts to find an engine that went away
REQUEST_TIMEOUT = 60.0  # a stream silent this long is dead (the engine heartbeats every second)
STATS_EVERY = 0.25  # seconds between two stats callbacks: four frames a second are plenty for the panels


@dataclass
class LinkState:
    """`kind` is one of: connecting, starting, connected, stalled, lost, failed. `detail` is the status
    line's sentence; `cause` what happened, without what the link does next (for interrupted replies);
    `model` the engine's model while connected (the status line keeps it where it cuts the detail)."""

    kind: str
    detail: str
    cause: str = ""
    model: str = ""

    @property
    def connected(self) -> bool:
        return self.kind in ("connected", "stalled")


def listening(address: str) -> bool:
    """Something accepts connections at `address` (true of a busy engine, false of a dead one)."""
    scheme, rest = split(address)
    if scheme == "ipc":
        return ipc_listening(rest)
    host, _, port = rest.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=0.5).close()
    except OSError:
        return False
    return True


AbortResult = Literal["aborted", "finished", "unreachable"]


def start_cause(error: str) -> str:
    """The line of a failed start's log that says why: the serve command's own error line (`minichat
    serve: error: cannot load the model: ...`), else a Python exception, else the log's last line."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    for prefix in ("minichat serve: error: ", "Error: "):
        found = [line.removeprefix(prefix) for line in lines if line.startswith(prefix)]
        if found:
            return found[-1]
    exceptions = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return exceptions[-1] if exceptions else lines[-1] if lines else error


def model_summary(info: Info) -> list[str]:
    """What the console says of the model besides its name, in a few words each: its family, experts and window
    (the engine's `model_info`, shortened), the format and memory of its weights ("Q4_1+Q8_0, 92.1 MiB")."""
    model = info.model_info
    parts = [model["family"]] if "family" in model else []
    if "experts" in model:
        total, per_token = model["experts"].split(" (")[0].split(", ")
        parts.append(f"{total} experts, {per_token}")
    if model.get("window", "none") != "none":
        parts.append("window " + model["window"].split(" tokens")[0])
    weights = info.execution.get("weights")
    return parts + ([weights] if weights else [])


def restart_options(info: Info) -> tuple[str, dict[str, Any]]:
    """The model and `minichat serve` options an engine reported, to start it again as it was."""
    names = set(option_fields()) | {"max_waiting_requests", "max_message_bytes",
                                                                 "allow_remote"}
    return info.model, {k: v for k, v in info.config.items() if k in names and k != "model"}


def stopped_on_request(handle: EngineHandle, wait: float = 10.0) -> bool:
    """Whether the engine `handle` started ended as asked (a protocol shutdown or SIGTERM: exit status 0), not by a
    crash or a kill; waits up to `wait` seconds for the process to finish its shutdown."""
    if handle.process is None:
        return False
    try:
        return handle.process.wait(wait) == 0
    except subprocess.TimeoutExpired:
        return False


@dataclass
class EngineLink:
    """Finds (or, when `autostart`, starts) the engine at `address` and keeps a client to it.

    When the engine goes away the link looks again (and, with `autostart`, starts a new one), so
    conversations survive an engine restart. A failed start is not repeated on its own, since it
    would most likely fail the same way; `retry()` (the app's Reconnect command) tries again.
    """

    address: str = field(default_factory=default_address)
    model: str | None = None
    autostart: bool = True
    engine_options: dict[str, Any] = field(default_factory=dict)
    on_stats: Callable[[Stats], None] = lambda stats: None
    on_state: Callable[[LinkState], None] = lambda state: None
    names: RequestNames = field(default_factory=RequestNames)
    state: LinkState = field(default_factory=lambda: LinkState("connecting", "looking for an engine…"))
    info: Info | None = None
    client: AsyncEngineClient | None = None
    handle: EngineHandle | None = None
    start_failed: bool = False
    lost_options: tuple[str, dict[str, Any]] | None = None  # model and options of a lost engine we did not start
    stats: Stats | None = None  # the newest snapshot, kept for whoever reads rather than listens (the fleet view)
    stats_at: float = 0.0  # monotonic time it arrived
    stats_every: float = STATS_EVERY  # seconds between two callbacks (slower for a replica nobody looks at)

    def __post_init__(self) -> None:
        self._ready = asyncio.Event()
        self._retry = asyncio.Event()
        self._start_done: threading.Event | None = None

    @property
    def interruption(self) -> str | None:
        """Why replies cannot continue right now (None while connected)."""
        return None if self.state.connected else self.state.detail

    def _set(self, kind: str, detail: str, cause: str = "", model: str = "") -> None:
        if (kind, detail, model) != (self.state.kind, self.state.detail, self.state.model):
            self.state = LinkState(kind, detail, cause or detail, model)
            self.on_state(self.state)

    async def ready(self) -> AsyncEngineClient:
        """The client, once an engine is connected (waits while it is being found or started)."""
        while True:
            await self._ready.wait()
            if self.client is not None:
                return self.client

    def retry(self) -> str:
        """Try again now, starting an engine even if the last start failed (an engine this console did
        not start is started again with its own model and options); returns what it will do."""
        self.start_failed = False
        if self.lost_options is not None:
            self.model, self.engine_options = self.lost_options
            self.lost_options = None
        self._retry.set()
        if self.autostart:
            model = model_id(self.model) if self.model else "the demo model"
            return f"looking for the engine at {self.address}, and starting {model} if none answers"
        return f"looking for the engine at {self.address}"

    async def abort(self, rid: str) -> AbortResult:
        """Abort a live request: `aborted`, `finished` (it ended meanwhile, or was never there; either
        way it is gone) or `unreachable` (no engine could be asked; the caller stops it locally)."""
        if self.client is None or not self.state.connected:
            return "unreachable"
        try:
            await self.client.abort(rid, timeout=5.0)
        except EngineError:
            return "finished"
        except EngineUnavailable:
            return "unreachable"
        return "aborted"

    async def describe(self, rid: str, text_from: int = 0) -> Description | None:
        """Everything the engine can say about a request (its output from character `text_from` on);
        None when no engine could be asked."""
        if self.client is None or not self.state.connected:
            return None
        try:
            return await self.client.describe(rid, text_from, timeout=5.0)
        except (EngineError, EngineUnavailable):
            return None

    async def run(self) -> None:
        """Find or start, watch until the engine goes, repeat; runs for the life of the app."""
        while True:
            try:
                handle = await self._find_or_start()
                if handle is not None:
                    why = await self._attach(handle)
                    await self.close()
                    if handle.started and await asyncio.to_thread(stopped_on_request, handle):
                        # `minichat stop` (or a signal) ended the engine this console started: a stop that was
                        # asked for is a stop; starting another in its place would undo it
                        self.start_failed, self.handle = True, None
                        model = model_id(self.model) if self.model else "the demo model"
                        self._set("lost", f"the engine was stopped (by `minichat stop` or a signal); /reconnect "
                                          f"starts {model} again", cause=why)
                    elif self.autostart and not handle.started and self.info is not None:
                        # someone else's engine: starting ours in its place, with other settings, would
                        # surprise; wait for it, and let the person start it again with its own options
                        self.start_failed, self.lost_options = True, restart_options(self.info)
                        self._set("lost", f"{why}; it was not started by this console: start it again, or "
                                          f"/reconnect to start {model_id(self.info.model)} here with the "
                                          f"options it had", cause=why)
                    else:
                        self._set("lost", f"{why}; reconnecting…", cause=why)
                    continue
            except Exception as e:  # a surprise must not end the link: report it and wait for a retry
                await self.close()
                self.start_failed = True
                self._set("failed", f"engine link error: {type(e).__name__}: {e}")
            self._retry.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._retry.wait(), RETRY_EVERY)

    async def _find_or_start(self) -> EngineHandle | None:
        handle = await asyncio.to_thread(find, self.address)
        if handle is not None:
            return handle
        if not self.autostart or self.start_failed:
            if self.state.kind not in ("lost", "failed"):
                self._set("lost", f"no engine answers at {self.address}; waiting for one…")
            return None
        if self.model is None and not (DEMO_MODEL_DIR / "config.json").is_file():
            self.start_failed = True
            self._set("failed", "no model: the embedded demo model is not built yet; run `minichat --model PATH` "
                                "with an HF checkpoint directory, or attach with --address to a running engine")
            return None
        self._set("starting", f"starting an engine for {self.model or 'the demo model'} at {self.address}…")
        try:
            return await asyncio.to_thread(self._start)
        except EngineStartError as e:
            self.start_failed = True
            self._set("failed", f"the engine did not start: {start_cause(str(e))}. Check the model and engine "
                                f"options (the whole log: {log_path(self.address)}), then /reconnect")
            return None
        except (AddressError, OSError, ValueError) as e:
            self.start_failed = True
            self._set("failed", f"the engine did not start: {e}")
            return None

    def _start(self) -> EngineHandle:
        """Start an engine (blocking; in a thread). The handle is kept even if the app quits meanwhile,
        so that `stop_engine` can still stop what was started."""
        done = self._start_done = threading.Event()
        try:
            handle = start(self.address, model=self.model, **self.engine_options)
            if handle.started:
                self.handle = handle
            return handle
        finally:
            done.set()

    async def _attach(self, handle: EngineHandle) -> str:
        """Connect a client and pass stats on until the engine is gone; returns why it is gone."""
        # the name labels this console's requests in the engine's stats, for whoever else watches them
        self.client = handle.async_client(timeout=REQUEST_TIMEOUT, name=f"console pid {os.getpid()}")
        try:
            self.info = await self.client.info(timeout=5.0)
        except EngineUnavailable:
            return f"the engine at {self.address} did not answer"
        connected = " · ".join([*model_summary(self.info), f"pid {self.info.pid}", self.address])
        model = model_id(self.info.model)
        self._set("connected", connected, model=model)
        self._ready.set()
        while True:
            try:
                stats = await self.client.stats(STALL_AFTER)
            except EngineUnavailable:
                if not await asyncio.to_thread(listening, self.address):
                    return f"the engine at {self.address} stopped"
                self._set("stalled", f"no stats for {STALL_AFTER:g} s; the engine is busy or stuck", model=model)
                continue
            self._set("connected", connected, model=model)
            self.stats, self.stats_at = stats, time.monotonic()
            self.on_stats(stats)
            await asyncio.sleep(self.stats_every)

    async def close(self) -> None:
        """Drop the client (the engine is gone, or the app is closing); stopping an engine is `stop_engine`'s."""
        self._ready.clear()
        if self.client is not None:
            await self.client.close()
            self.client = None

    def stop_engine(self) -> None:
        """Stop the engine if this link started it (on the way out of the app); blocking, and waits for
        an engine still starting rather than leave it running unowned."""
        if self._start_done is not None:
            self._start_done.wait()
        if self.handle is not None:
            self.handle.stop()
