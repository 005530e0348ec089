"""The edge: what a connection and a request must pass before any route reads them.

Two layers, because uvicorn leaves both to the application:

- `GuardedH11Protocol`, per connection (under uvicorn, which has no header or body timeout and no cap on
  connections): at most `max_connections` open (one beyond is answered 503 and closed at once, unread, so
  that the process never runs out of descriptors, which would lock every client out and leave none for the
  engine connection to reconnect with; a client that had sent its request may see the connection reset
  rather than the 503), and each request must arrive whole, headers and body, within
  `read_timeout` of the moment the connection started waiting for it; bytes trickling in do not push that
  back (uvicorn's keep-alive timer restarts with every byte).
- `EdgeGuard`, per request (pure ASGI, in front of FastAPI): the Host header when there is no API key (a
  page that rebinds its DNS name to 127.0.0.1 would otherwise drive a key-less loopback API), the API key
  from the headers (before one byte of the body is read or parsed: an unauthenticated body costs nothing),
  the body size (413 before reading when Content-Length says so, else as soon as it is exceeded), and
  strings JSON can spell but text cannot (lone UTF-16 surrogates), refused naming the field. Every refusal
  has OpenAI's error shape and is counted in `minichat_http_requests_total`. It also answers a bug in a
  route with a 500 of that shape on a connection that stays open (raised on, the exception would make
  uvicorn drop the connection, and the client's next request on it with it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from typing import Any
from urllib.parse import urlsplit

import h11
import uvicorn
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.service.addresses import is_loopback
from engine.service.http.errors import ApiError, param_name
from engine.service.http.metrics import Metrics, endpoint_label
from engine.service.options import ApiOptions

log = logging.getLogger("minichat.http")

# asyncio accepts up to `backlog` connections in one go before any of them is seen (and closed if over the
# cap), and the sockets it closes go only at the next turn of the loop, so two bursts can overlap: the
# listen backlog, and half the descriptors kept free for bursts (a loaded machine showed one was not enough).
ACCEPT_BURST = 128
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (a liveness probe must not need the secret)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate, paired or not


class EdgeConfig(uvicorn.Config):
    """uvicorn's Config plus what `GuardedH11Protocol` reads (every connection of the server shares it)."""

    def __init__(self, app: ASGIApp, options: ApiOptions, max_connections: int, log_level: str) -> None:
        super().__init__(app, host=options.host, port=options.port, log_level=log_level,
                         access_log=log_level == "debug", http=GuardedH11Protocol, backlog=ACCEPT_BURST,
                         timeout_graceful_shutdown=options.drain_timeout)
        self.max_connections = max_connections
        self.read_timeout = options.read_timeout
        self.refused = self.timed_out = 0  # connections closed over the cap, and for arriving too slowly


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a connection cap and a deadline per request (see the module)."""

    config: EdgeConfig

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._over_cap = len(self.connections) >= self.config.max_connections
        if self._over_cap:
            self.config.refused += 1
            if self.config.refused == 1 or self.config.refused % 1000 == 0:
                log.warning("connection cap (%d) reached: refusing new connections (%d so far)",
                            self.config.max_connections, self.config.refused)
            transport.write(_raw_response(ApiError(
                503, f"this server has {self.config.max_connections} connections open, its limit; retry later",
                "server_error", code="too_many_connections")))
            transport.close()
            return
        super().connection_made(transport)
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if not self._over_cap:  # a refused connection never became uvicorn's
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse: answered in OpenAI's shape too, then closed (as uvicorn does)."""
        self.transport.write(_raw_response(ApiError(400, f"{msg} (malformed HTTP)", code="invalid_http")))
        self.transport.close()

    def _follow(self) -> None:
        """Arm the deadline while a request is awaited or incomplete; disarm it once the request is whole."""
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            if self._deadline is None:
                self._deadline = self.loop.call_later(self.config.read_timeout, self._too_slow)
        else:
            self._disarm()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        self.config.timed_out += 1
        if self.config.timed_out == 1 or self.config.timed_out % 1000 == 0:
            log.warning("closed a connection whose request did not arrive within %gs (%d so far)",
                        self.config.read_timeout, self.config.timed_out)
        self.transport.close()


def _raw_response(error: ApiError) -> bytes:
    """A whole HTTP/1.1 response carrying `error`, for answers given outside any request cycle."""
    body = json.dumps(error.body()).encode()
    status = error.status
    reason = {400: b"Bad Request", 503: b"Service Unavailable"}[status]
    extra = b"".join(f"{name}: {value}\r\n".encode() for name, value in error.headers.items())
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n%s\r\n"
            % (status, reason, len(body), extra) + body)


class _Disconnected(Exception):
    """The client left while its request body was being read: there is nobody to answer."""


class EdgeGuard:
    """The per-request checks in front of the app (see the module); the body is read here, whole, and
    handed on as one message."""

    def __init__(self, app: ASGIApp, options: ApiOptions, metrics: Metrics) -> None:
        self.app, self.options, self.metrics = app, options, metrics
        self.key = options.api_key.encode() if options.api_key is not None else None
        # Without a key, a loopback API answers only requests that name it by a loopback name: a page whose
        # name was rebound to this machine sends its own name. Beyond loopback (--allow-remote), any name may.
        self.check_host = self.key is None and is_loopback(options.host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._admit(scope, receive)
        except ApiError as e:
            await self._refuse(e, scope, receive, send, close=True)  # the rest of the body, if any, is never read
            return
        except _Disconnected:
            return
        if (error := _surrogate_error(body)) is not None:
            await self._refuse(error, scope, receive, send, close=False)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, _replay(body, receive), watched)
        except Exception:
            log.exception("unhandled error")
            if not started:  # once the response has started, uvicorn ends it by closing the connection
                await self._refuse(ApiError(500, "internal error in the HTTP front end (see its log)",
                                            "server_error", code="internal"), scope, receive, send, close=False)

    async def _refuse(self, error: ApiError, scope: Scope, receive: Receive, send: Send, close: bool) -> None:
        self.metrics.requests.labels(endpoint_label(scope["path"]), str(error.status)).inc()
        response = error.response(scope["path"])
        if close:
            response.headers["connection"] = "close"
        await response(scope, receive, send)

    async def _admit(self, scope: Scope, receive: Receive) -> bytes:
        """The request's body, read whole once the checks from its headers passed; ApiError for the first
        that does not (the body then stays unread, or partly read)."""
        headers = Headers(scope=scope)
        if self.check_host and "host" in headers and not _loopback_name(headers["host"]):
            raise ApiError(403, f"Host {headers['host'][:100]!r} does not name this server ({self.options.host}); "
                                f"without an API key it answers only requests addressed to a loopback name",
                           code="host_not_allowed")
        if self.key is not None and scope["path"] not in OPEN_PATHS and not self._keyed(headers):
            raise ApiError(401, "Missing or incorrect API key; send `Authorization: Bearer <key>` or "
                                "`x-api-key: <key>`.", code="invalid_api_key")
        limit = self.options.max_body_bytes
        if int(headers.get("content-length", "0")) > limit:  # h11 has checked that it is a number
            raise _too_large(int(headers["content-length"]), limit)
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


    def _keyed(self, headers: Headers) -> bool:
        """The request carries the API key: as a bearer token (OpenAI's clients) or in `x-api-key`
        (Anthropic's)."""
        assert self.key is not None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "")
        return secrets.compare_digest(given.strip().encode("latin-1"), self.key)


def _loopback_name(host: str) -> bool:
    """Whether a Host header names a loopback address (localhost, 127.0.0.1, [::1], with any port)."""
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:  # a port that is not a number
        return False
    return name is not None and is_loopback(name)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"The request body is {size:,} bytes or more, more than this server's limit of {limit:,} "
                         f"(--max-body-bytes).", code="too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app: the body already read, then whatever comes next (the disconnect)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _surrogate_error(body: bytes) -> ApiError | None:
    """The 400 for a body with a string that holds a lone surrogate, naming its field; None for any other."""
    if not _SURROGATE_ESCAPE.search(body) or (path := _lone_surrogate(body)) is None:
        return None
    param = (param_name(path) or "")[:200] or None  # a key the client wrote: shown, but not at any length
    return ApiError(400, f"{param or 'body'}: contains a lone surrogate (a \\ud800-\\udfff escape that is not half "
                         f"of a pair), which is not text", param=param, code="invalid_value")


def _lone_surrogate(body: bytes) -> list[str | int] | None:
    """Where the JSON body holds a string with a lone surrogate (which no encoding can carry), if it does;
    a body that is no JSON is left to the app's parser."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[list[str | int], Any]] = [([], data)]
    while stack:  # iterative: the depth is the client's choice
        path, node = stack.pop()
        if isinstance(node, str) and _has_surrogate(node):
            return path
        if isinstance(node, dict):
            for key, value in node.items():
                if _has_surrogate(key):
                    return path  # the object holding the key: the key itself cannot be shown
                stack.append(([*path, key], value))
        elif isinstance(node, list):
            stack.extend(([*path, i], value) for i, value in enumerate(node))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False
