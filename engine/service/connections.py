"""Connection limits: file descriptors and a cap on accepted connections.

libzmq aborts the whole process when `accept` fails with "Too many open files" (an ipc listener has no
recovery path), so the engine must never let connections use up its descriptors. It raises its soft
descriptor limit to the hard one at start, and a `ConnectionCap` thread watches the listening sockets'
monitor events: a connection accepted beyond the cap is shut down at once (`shutdown(2)` on its
descriptor; libzmq then sees an ordinary disconnect and closes it), so existing clients keep being
served while new ones are turned away.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import threading

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

FD_HEADROOM = 128  # descriptors kept for the engine's own files and for a burst the cap has not caught yet
HEADROOM_SHARE = 4  # and at least a quarter of the limit: under a loaded machine the cap's thread fell more than 128
# accepts behind a burst of 1,014 connections at a limit of 1,024 and libzmq aborted (the clean-clone CI, once)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # e.g. above fs.nr_open: keep what we have
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def connection_cap(wanted: int, fd_limit: int) -> int:
    """At most `wanted` connections, and never so many that accepting one could run out of descriptors."""
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    return max(1, min(wanted, fd_limit - in_use - max(FD_HEADROOM, fd_limit // HEADROOM_SHARE)))


class ConnectionCap(threading.Thread):
    """Counts the connections accepted by `sockets` and shuts down those beyond `cap`."""

    def __init__(self, sockets: list[zmq.Socket], cap: int) -> None:
        super().__init__(name="connection-cap", daemon=True)
        self.cap = cap
        self.refused = 0
        self._monitors = [s.get_monitor_socket(_EVENTS) for s in sockets]
        self._open: set[int] = set()
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=2)
        for m in self._monitors:
            m.close(linger=0)

    def run(self) -> None:
        poller = zmq.Poller()
        for m in self._monitors:
            poller.register(m, zmq.POLLIN)
        while not self._stopping.is_set():
            for sock, _ in poller.poll(100):
                message = parse_monitor_message(sock.recv_multipart())
                self._on_event(message["event"], message["value"])

    def _on_event(self, event: int, fd: int) -> None:
        if event != zmq.EVENT_ACCEPTED:
            self._open.discard(fd)
            return
        if len(self._open) < self.cap:
            self._open.add(fd)
            return
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning("connection cap (%d) reached: refusing new connections (%d so far)", self.cap, self.refused)
        try:
            conn = socket.socket(fileno=fd)
        except OSError:
            return  # already closed
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the peer is already gone
        finally:
            conn.detach()  # libzmq owns the descriptor and closes it when it sees the hang-up
