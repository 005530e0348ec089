"""StatsPublisher: the engine's XPUB socket, and when a stats snapshot is worth building and sending.

XPUB reports every subscribe (XPUB_VERBOSE) and each topic's last unsubscribe, so the publisher knows
whether anyone listens: with nobody, no snapshot is even built. With listeners, a snapshot goes out
about ten times a second, on a change of state (rate-limited), and at once when busy/idle flips or
someone new subscribes. A SUB misses what was sent before it joined, so each snapshot stands alone but
for the KV page map, which lists only the pages that changed since the last snapshot that listed every
page (engine/service/stats.py); a new subscriber asks for such a snapshot.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import zmq

from engine.service import protocol

STATS_INTERVAL = 0.1  # publish at least this often (seconds) ...
STATS_MIN_INTERVAL = 0.05  # ... and on a change of state, but not more often than this


class StatsPublisher:
    """Publishes `build()`'s snapshot on `pub` while someone subscribes; `changed()` marks new state."""

    def __init__(self, pub: zmq.Socket, build: Callable[[bool], protocol.Stats]) -> None:
        """`build(full)`: the next snapshot; `full` when a new subscriber needs every page listed."""
        self.pub = pub
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscribe, not only a topic's first
        self._build = build
        self._topics: set[bytes] = set()  # subscribed topics: empty exactly when nobody listens
        self._newcomer = False  # someone subscribed since the last snapshot
        self._dirty = True
        self._was_idle = True
        self._last = 0.0

    @property
    def listening(self) -> bool:
        return bool(self._topics)

    def changed(self) -> None:
        self._dirty = True

    def wait_ms(self) -> int:
        """How long an idle loop may block before the next snapshot is due (only while someone listens)."""
        return max(0, int((self._last + STATS_INTERVAL - time.monotonic()) * 1000) + 1)

    def read_subscriptions(self) -> None:
        """Track who subscribes; a new subscriber gets a snapshot at once."""
        while True:
            try:
                event = self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if event[:1] == b"\x01":
                self._topics.add(event[1:])
                self._dirty, self._last, self._newcomer = True, 0.0, True
            else:
                self._topics.discard(event[1:])

    def publish(self, idle: bool, force: bool = False) -> None:
        """Send a snapshot if one is due (see the module docstring); `idle`: the engine has no work."""
        if not self._topics:
            return
        now = time.monotonic()
        since = now - self._last
        changed = self._dirty and (since >= STATS_MIN_INTERVAL or idle != self._was_idle)
        if not (force or changed or since >= STATS_INTERVAL):
            return
        with contextlib.suppress(zmq.Again):
            self.pub.send(protocol.encode(self._build(self._newcomer)), zmq.NOBLOCK)
        self._last, self._dirty, self._was_idle, self._newcomer = now, False, idle, False
