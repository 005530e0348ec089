"""Outbox: the engine's replies to each client, held here while the client's ZeroMQ queue is full.

A client is cut off when it reads nothing for `stall_seconds`, not when its queue first fills: a queue
holds `client_buffer_messages` replies, one per step, so with a small model (a millisecond a step) a
client whose process is busy for one second would otherwise lose its requests. Held replies keep their
order (everything to a client goes through here once something is held for it), and memory stays
bounded by time: a client that reads nothing is dropped after `stall_seconds` of replies.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import zmq


@dataclass
class _Held:
    """Replies for one client that its queue could not take, oldest first; `since` is when the client last
    took one (or when the first was held)."""

    since: float
    frames: deque[bytes] = field(default_factory=deque)


class ClientGone(Exception):
    """A client the engine cannot reach: it disconnected, or read nothing for too long. `why` says which."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Outbox:
    """Sends on the router without blocking; what a full queue refuses waits here until `flush` gets it out."""

    def __init__(self, router: zmq.Socket, stall_seconds: float) -> None:
        self.router = router
        self.stall_seconds = stall_seconds
        self._held: dict[bytes, _Held] = {}

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def send(self, identity: bytes, data: bytes) -> None:
        """Send now, or hold behind what is held for this client already; ClientGone if it disconnected."""
        held = self._held.get(identity)
        if held is not None:
            held.frames.append(data)
            return
        if not self._try(identity, data):
            self._held[identity] = _Held(time.monotonic(), deque([data]))

    def flush(self) -> list[tuple[bytes, str]]:
        """Send what each client's queue takes now; the clients to drop, with why: gone, or stalled too long."""
        gone: list[tuple[bytes, str]] = []
        now = time.monotonic()
        for identity, held in list(self._held.items()):
            try:
                while held.frames and self._try(identity, held.frames[0]):
                    held.frames.popleft()
                    held.since = now
            except ClientGone as e:
                gone.append((identity, e.why))
                continue
            if not held.frames:
                del self._held[identity]
            elif now - held.since >= self.stall_seconds:
                gone.append((identity, f"it read none of its replies for {self.stall_seconds:g} s "
                                       f"({len(held.frames)} more waiting)"))
        return gone

    def forget(self, identity: bytes) -> None:
        self._held.pop(identity, None)

    def _try(self, identity: bytes, data: bytes) -> bool:
        try:
            self.router.send_multipart([identity, data], zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: it has not read its last client_buffer_messages replies
            return False
        except zmq.ZMQError as e:
            unreachable = e.errno == zmq.EHOSTUNREACH
            raise ClientGone("it disconnected, or stopped reading and missed its heartbeats" if unreachable
                             else e.strerror) from None
        return True
