"""Raw-socket helpers for the process-level tests: speak the documented protocol with a bare DEALER."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import zmq

pack, unpack = msgspec.msgpack.encode, msgspec.msgpack.decode


@contextmanager
def raw_dealer(address: str, options: dict[int, int] | None = None) -> Iterator[zmq.Socket]:
    """A DEALER connected to the engine, closed without lingering; `options` are socket options set before it
    connects."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()


def reply(sock: zmq.Socket, timeout: float = 10.0) -> dict:
    """The next message that is not a heartbeat, decoded as a plain dict."""
    while True:
        assert sock.poll(int(timeout * 1000)), "the engine did not reply"
        msg = unpack(sock.recv())
        if msg["type"] != "heartbeat":
            return msg
