"""The OpenAI-compatible HTTP front end: FastAPI routes (app), request bodies and the engine requests
they stand for (schemas), running those and dressing their outputs as choices (generation), OpenAI's
error shape and wording (errors), what the app shares (state), Prometheus metrics (metrics). It is
one more client of the engine, like the console: it reaches the engine over the ZeroMQ protocol
through `AsyncEngineClient`, so the engine loop knows nothing about HTTP.

    minichat serve --http 127.0.0.1:8000          # an engine and this front end
    minichat api --address ipc:///... --port 8000  # this front end for a running engine
"""

from __future__ import annotations

import errno
import logging
import signal
import socket

import uvicorn

from engine.service.addresses import AddressError, is_loopback
from engine.service.connections import connection_cap, raise_fd_limit
from engine.service.http.app import create_app
from engine.service.http.edge import ACCEPT_BURST, EdgeConfig
from engine.service.http.models import ModelRouter
from engine.service.options import ApiOptions

__all__ = ["ApiOptions", "check_host", "create_app", "listen", "run_api"]

log = logging.getLogger("minichat.http")


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse to listen beyond loopback unless the operator asked for it."""
    if not allow_remote and not is_loopback(host):
        raise AddressError(f"{host} is not a loopback address; pass --allow-remote to listen on it "
                           f"(and --api-key to require a key)")


def listen(host: str, port: int) -> socket.socket:
    """The API's listening socket, bound before anything else starts (an engine takes seconds to load): a port
    another process holds is an AddressError of one line, not uvicorn's after the load. uvicorn then serves on
    this very socket, so nothing can take the port in between."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise AddressError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT does not hold it
        sock.bind(where)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        held = " (another process listens there; choose another port)" if e.errno == errno.EADDRINUSE else ""
        raise AddressError(f"cannot listen on {host}:{port}: {e.strerror}{held}") from e
    return sock


def run_api(options: ApiOptions, log_level: str = "info", sock: socket.socket | None = None,
            router: ModelRouter | None = None) -> None:
    """Serve the API with uvicorn in the foreground at `options.host:port`; returns after Ctrl-C or SIGTERM,
    once in-flight requests are done or `options.drain_timeout` has passed (then they are cut), so the
    caller can still clean up (stop the engine it started). It serves on `sock` where given (`listen`).

    The open-file limit is raised to the hard limit first, as the engine does, and the connection cap kept
    below it with room for a burst of accepts and for the engine connection to reconnect (edge.py)."""
    cap = connection_cap(options.max_http_connections, raise_fd_limit() - 2 * ACCEPT_BURST)
    if cap < options.max_http_connections:
        log.warning("the open-file limit allows %d HTTP connections at once, not %d", cap,
                    options.max_http_connections)
    server = uvicorn.Server(EdgeConfig(create_app(options, router), options, cap, log_level))
    # uvicorn shuts down gracefully on the signal, then re-raises it into the handlers it found: make those
    # no-ops for the duration, or SIGTERM would kill this process before its caller's cleanup.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
