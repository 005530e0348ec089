"""Sockets: the engine's two listening sockets, a ROUTER for requests and their streams and an XPUB for
live stats, bound before the model loads so that a taken address fails fast.

Everything about them that guards the engine lives here: owner-only files, ZeroMQ PLAIN auth with a
ZAP handler thread, size and queue limits, heartbeats, handshake timeouts, and the cap on accepted
connections below the open-file limit (connections.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets

import zmq
from zmq.auth.thread import ThreadAuthenticator

from engine.service.addresses import AddressError, check_bindable, remove_stale_ipc, split, stats_address
from engine.service.client import AUTH_USER, EngineRefused, probe
from engine.service.connections import ConnectionCap, connection_cap, raise_fd_limit
from engine.service.options import ServerOptions

log = logging.getLogger(__name__)

SEND_BUFFER = 128 << 10  # kernel send buffer per connection (bytes)
SUBSCRIPTION_BYTES = 64  # largest accepted stats subscription message (clients subscribe to "")
HANDSHAKE_MS = 5000  # a connection that has not completed the ZeroMQ handshake by then is closed
# The socket takes frames up to this many times --max-message-bytes, so that one over the limit is still read
# and refused with an error naming its request (server.py); only beyond this does ZeroMQ drop the connection,
# with every other request it carries (one connection carries all of a front end's or a console's streams).
FRAME_ALLOWANCE = 4


class Sockets:
    """The engine's two listening sockets, bound before the model loads so a taken address fails fast.

    Both are created owner-only (0600, in a 0700 directory) whatever the umask; with an auth token they
    accept only ZeroMQ PLAIN handshakes carrying it (checked by a ZAP handler thread)."""

    def __init__(self, address: str, options: ServerOptions) -> None:
        check_bindable(address, options.allow_remote, options.auth_token is not None)
        try:
            running = probe(address, auth_token=options.auth_token)
        except EngineRefused as e:
            raise AddressError(f"{e}: an engine already answers there; stop it or choose another --address") from e
        if running is not None:
            raise AddressError(f"an engine (pid {running.pid}, minichat {running.version}) already answers at "
                               f"{address}; stop it with `minichat stop` or choose another --address")
        remove_stale_ipc(address)  # also creates the socket's directory, mode 0700
        self.address, self.stats_address = address, stats_address(address)
        self.ctx = zmq.Context()
        self.auth: ThreadAuthenticator | None = None
        if options.auth_token is not None:
            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_plain(domain="*", passwords={AUTH_USER: options.auth_token})
        # libzmq numbers anonymous peers from rand(), which nobody seeds: every engine's first peer id
        # was 00 6b8b4567, and a peer that claimed the next ids itself made libzmq abort on the
        # collision. Seeded, the ids a ROUTER assigns cannot be guessed.
        ctypes.CDLL(None).srand(secrets.randbits(32))
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes * FRAME_ALLOWANCE)
        self.router.setsockopt(zmq.SNDHWM, options.client_buffer_messages)
        self.router.setsockopt(zmq.SNDBUF, SEND_BUFFER)
        self.router.setsockopt(zmq.HEARTBEAT_IVL, 2000)  # transport-level: notices half-open tcp peers
        self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        self.pub = self.ctx.socket(zmq.XPUB)  # XPUB: it tells us whether anyone subscribes
        # A subscription is stored (by libzmq and in _topics): MiB-long ones cost hundreds of MiB.
        self.pub.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_BYTES)
        self.pub.setsockopt(zmq.SNDHWM, 16)  # a slow dashboard misses snapshots rather than queueing them
        self.pub.setsockopt(zmq.LINGER, 0)
        for sock in (self.router, self.pub):
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
            if options.auth_token is not None:
                sock.setsockopt(zmq.PLAIN_SERVER, 1)
        fd_limit = raise_fd_limit()
        self.cap = ConnectionCap([self.router, self.pub], connection_cap(options.max_connections, fd_limit))
        self.cap.start()
        old_umask = os.umask(0o077)  # the socket files are created by bind: owner-only from the start
        try:
            for sock, addr in ((self.router, self.address), (self.pub, self.stats_address)):
                try:
                    sock.bind(addr)
                except zmq.ZMQError as e:
                    self.close(linger=0)
                    raise AddressError(f"cannot listen on {addr}: {e.strerror}") from e
                scheme, path = split(addr)
                if scheme == "ipc":
                    os.chmod(path, 0o600)  # 0700 from bind under umask 077; nothing executes a socket
        finally:
            os.umask(old_umask)
        log.info("accepting up to %d connections (open-file limit %d)", self.cap.cap, fd_limit)

    def close(self, linger: int) -> None:
        """Close both sockets (waiting up to `linger` ms to deliver final replies) and remove ipc files."""
        self.cap.stop()
        self.router.close(linger=linger)
        self.pub.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        for addr in (self.address, self.stats_address):
            scheme, path = split(addr)
            if scheme == "ipc":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
