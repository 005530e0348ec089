"""The sockets a client opens, the same for both transports: a DEALER to the engine (with a monitor of
its connection) and a SUB for its stats, each presenting the auth token when there is one."""

from __future__ import annotations

from typing import TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from engine.service.addresses import stats_address
from engine.service.client.core import AUTH_USER

S = TypeVar("S", bound=zmq.Socket)
_REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
STATS_QUEUE = 100  # stats snapshots a SUB holds for its reader: ten seconds of them


def _secure(sock: S, token: str | None) -> S:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT
    if token is not None:
        sock.setsockopt(zmq.PLAIN_USERNAME, AUTH_USER.encode())
        sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
    return sock


def dealer(ctx: zmq.Context[S], address: str, token: str | None = None) -> tuple[S, S]:
    """A DEALER connected to the engine, and a monitor of its connection: disconnects, and the engine
    refusing this client's handshake (a wrong token fails PLAIN's; no token, where the engine wants one,
    fails the protocol's)."""
    sock = _secure(ctx.socket(zmq.DEALER), token)
    sock.setsockopt(zmq.RCVHWM, 0)  # never make the engine's send fail because we read slowly
    sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
    # before connecting: a refusal can come back before the next line would run
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _REFUSALS)
    sock.connect(address)
    return sock, monitor


def subscriber(ctx: zmq.Context[S], address: str, token: str | None = None) -> S:
    """A SUB for the stats. Not conflating: a snapshot's page map may be changes to an earlier one, so the
    reader takes every queued snapshot in order (core.StatsFeed); a reader that stops reading holds at
    most STATS_QUEUE of them (the engine drops what does not fit)."""
    sock = _secure(ctx.socket(zmq.SUB), token)
    sock.setsockopt(zmq.RCVHWM, STATS_QUEUE)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(stats_address(address))
    return sock


def is_refusal(frames: list[bytes]) -> bool:
    """Whether a monitor event says the engine refused this client's handshake."""
    return bool(parse_monitor_message(frames)["event"] & _REFUSALS)


def close(sock: zmq.Socket, monitor: zmq.Socket, sub: zmq.Socket | None) -> None:
    """Close a client's sockets without lingering."""
    if not sock.closed:
        sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
    if sub is not None:
        sub.close(linger=0)
