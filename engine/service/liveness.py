"""Liveness during a long step: pings answered and clients heartbeaten while one step holds the loop.

The loop owns the request socket, and a step holds the loop: a 2,048-token prefill of the 0.5B shape
took 30-50 s on a loaded 2-core machine, and a front end that hears nothing for its ping timeout or
its stream timeout took the engine for dead (44 of 64 requests failed). ZeroMQ sockets are not
thread-safe but may change threads behind a full memory barrier, which a lock is. So the loop holds
the socket's lock except inside a step, and a step that runs past ENGAGE_AFTER lends the socket to
this thread until it ends. The thread answers pings at once, with how long the step has run (slow,
not dead), and GetInfo (a step changes nothing in it); it heartbeats every client with live
requests, and keeps every other message, in arrival order, for the loop to handle after the step (a
Pong may so overtake an earlier message of the same client: replies are matched by key, not
order). Short steps never wake it: the loop pays two uncontended lock operations a step, and the
thread looks at the step in progress about ten times a second while steps run, never while the
engine is idle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import msgspec
import zmq

from engine.service import protocol

log = logging.getLogger(__name__)

ENGAGE_AFTER = 0.1  # seconds a step runs before this thread takes over the socket
SLOW_STEP = 10.0  # a step that runs this long is logged as slow, and again when it ends
MAX_HELD = 4096  # messages kept for the loop; beyond that the socket's own queue holds them
QUICK_BYTES = 64  # a Ping or a GetInfo is a few bytes; anything longer is neither and waits for the loop

# What the engine answers for a message while a step has run this many seconds, or None: the loop's job.
Replier = Callable[[protocol.ClientMessage, float], msgspec.Struct | None]


class StepCover:
    """Covers for the loop while a long step runs (see the module docstring). The loop wraps each step
    in `step()`, then handles `held` and drops the clients in `gone` (a send to them failed)."""

    def __init__(self, router: zmq.Socket, reply: Replier, live: Callable[[], Iterable[bytes]],
                 heartbeat_interval: float) -> None:
        self._router = router
        self._reply = reply
        self._live = live  # the clients with live requests; read only while the loop is inside a step
        self._interval = heartbeat_interval
        self._lock = threading.Lock()  # whoever holds it may use the socket: the loop, or during a long step us
        self._lock.acquire()
        self._cond = threading.Condition()
        self._steps = 0  # steps started
        self._running = False
        self._started = 0.0
        self._idle = False  # the thread waits for a step to start (and needs a notify)
        self._serving = False  # the thread has the socket, or is about to take it (and needs a wake-up)
        self._closed = False
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.held: deque[list[bytes]] = deque()
        self.gone: dict[bytes, str] = {}
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Lend the socket for the duration of one step."""
        with self._cond:
            self._steps += 1
            self._started, self._running = time.monotonic(), True
            if self._idle:
                self._cond.notify()
        self._lock.release()
        try:
            yield
        finally:
            with self._cond:
                self._running = False
                if self._serving:
                    os.eventfd_write(self._wake, 1)
            self._lock.acquire()

    def close(self) -> None:
        """Stop the thread for good; the loop keeps the socket."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            if self._serving:
                os.eventfd_write(self._wake, 1)
        self._lock.release()
        self._thread.join()
        self._lock.acquire()
        os.close(self._wake)

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle = True
                self._cond.wait_for(lambda: self._running or self._closed)
                self._idle = False
                if self._closed:
                    return
                step, due = self._steps, self._started + ENGAGE_AFTER
                while self._in_step(step) and (left := due - time.monotonic()) > 0:
                    self._cond.wait(left)  # nobody notifies a step's end: short steps cost the loop nothing
                if not self._in_step(step):
                    continue
                self._serving = True
            self._serve(step)

    def _in_step(self, step: int) -> bool:
        return self._running and self._steps == step and not self._closed

    def _serve(self, step: int) -> None:
        """Hold the socket until `step` ends: answer pings, heartbeat, keep the rest."""
        with self._lock:
            try:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)  # a wake-up left from an earlier step
                poller = zmq.Poller()
                poller.register(self._wake, zmq.POLLIN)
                next_beat, slow = time.monotonic(), False  # a beat at once: the loop was quiet for ENGAGE_AFTER
                while True:
                    with self._cond:
                        if not self._in_step(step):
                            break
                        started = self._started
                    now = time.monotonic()
                    if now >= next_beat:
                        for identity in list(self._live()):
                            self._send(identity, protocol.Heartbeat())
                        next_beat = now + self._interval
                    if not slow and now - started >= SLOW_STEP:
                        slow = True
                        log.warning("a step has run for %.0f s; answering pings and heartbeats meanwhile",
                                    now - started)
                    if len(self.held) < MAX_HELD:
                        poller.register(self._router, zmq.POLLIN)
                    else:
                        poller.unregister(self._router)
                    ready = dict(poller.poll(max(1, int((next_beat - now) * 1000))))
                    if self._wake in ready:
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(self._wake)
                    if self._router in ready:
                        self._read(started)
                if slow:
                    log.warning("the slow step ended after %.1f s", time.monotonic() - started)
            finally:
                with self._cond:
                    self._serving = False

    def _read(self, started: float) -> None:
        while len(self.held) < MAX_HELD:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self._quick_reply(frames, time.monotonic() - started)
            if reply is None:
                self.held.append(frames)
            else:
                self._send(frames[0], reply)

    def _quick_reply(self, frames: list[bytes], busy_for: float) -> msgspec.Struct | None:
        """The answer to a small message the thread may answer itself, else None."""
        if len(frames) != 2 or len(frames[1]) > QUICK_BYTES:
            return None
        try:
            return self._reply(protocol.decode_client(frames[1]), busy_for)
        except protocol.DecodeError:
            return None

    def _send(self, identity: bytes, msg: msgspec.Struct) -> None:
        if identity in self.gone:
            return
        try:
            self._router.send_multipart([identity, protocol.encode(msg)], zmq.NOBLOCK)
        except zmq.Again:  # its queue is full, of replies it has still to read: this heartbeat or pong is not needed
            pass
        except zmq.ZMQError as e:
            self.gone[identity] = f"it disconnected during a long step ({e.strerror})"

