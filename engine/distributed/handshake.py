"""The nodes' handshake, bounded in time: node 0's control listener and a rank on another node each prove the
shared token (multiprocessing's HMAC challenges, both ways), then the dialer names its rank.

multiprocessing's own `Client` / `Listener` wait for ever: a peer that connects and sends nothing (or one byte
now and then) held node 0's start past its own deadline, and the genuine node could not join. Here a timer shuts
the socket down when the limit passes, which ends any read blocked on it, whatever the peer sends or withholds.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

HANDSHAKE_LIMIT = 10.0  # seconds for the whole exchange: milliseconds on a LAN; a peer taking longer is not a node


class HandshakeFailed(Exception):
    """The peer did not prove the token, said something else than a join, or took longer than the limit."""


def handshake(sock: socket.socket, authkey: bytes, *, limit: float, rank: int | None = None) -> tuple[Connection, int]:
    """Authenticate a connected socket both ways within `limit` seconds and exchange the rank: the dialer
    (`rank` given) sends its rank, the listener (`rank` None) receives it. Returns the connection and the rank;
    HandshakeFailed otherwise. The socket is closed either way (the connection holds its own descriptor)."""
    cut = threading.Event()

    def cut_off() -> None:
        cut.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # a read blocked on it returns at once

    timer = threading.Timer(limit, cut_off)
    timer.daemon = True
    sock.settimeout(None)
    conn = Connection(os.dup(sock.fileno()))
    timer.start()
    try:
        if rank is None:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
            message = conn.recv()  # the peer proved the token: its pickle is a node's
            if not (isinstance(message, tuple) and len(message) == 2 and message[0] == "join"
                    and isinstance(message[1], int)):
                raise HandshakeFailed(f"it sent {type(message).__name__}, not a join")
            rank = message[1]
        else:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
            conn.send(("join", rank))
    except (AuthenticationError, EOFError, OSError, ValueError, TypeError, pickle.UnpicklingError,
            HandshakeFailed) as e:
        conn.close()
        if cut.is_set():
            raise HandshakeFailed(f"it did not complete the handshake within {limit:g} s") from None
        raise HandshakeFailed(str(e) if isinstance(e, HandshakeFailed) else f"{type(e).__name__}: {e}") from None
    finally:
        timer.cancel()
        sock.close()
    if cut.is_set():  # the limit passed just as it completed: the socket is shut
        conn.close()
        raise HandshakeFailed(f"it did not complete the handshake within {limit:g} s")
    return conn, rank
