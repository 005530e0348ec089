"""ServerOptions: the engine process's limits and access rules, on top of EngineConfig's engine limits;
ApiOptions: the HTTP front end's (a light module: the command line reads both)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerOptions:
    """Server-side limits, on top of EngineConfig's engine limits."""

    address: str | None = None
    allow_remote: bool = False
    max_waiting_requests: int = 1024
    max_message_bytes: int = 1 << 20
    auth_token: str | None = None
    max_connections: int = 4096
    client_buffer_messages: int = 1000  # replies ZeroMQ queues for a client; beyond, the engine holds them
    grammar_time_limit: float = 2.0  # seconds a request's grammar may compile before it is refused
    client_stall_seconds: float = 10.0  # a client that reads none of its replies this long loses its requests

    def __post_init__(self) -> None:
        if not self.grammar_time_limit > 0 or not self.client_stall_seconds > 0:
            raise ValueError("grammar_time_limit and client_stall_seconds must be > 0 seconds")
        if self.max_waiting_requests < 1 or self.max_message_bytes < 1024:
            raise ValueError("max_waiting_requests must be >= 1 and max_message_bytes >= 1024")
        if self.max_connections < 1 or self.client_buffer_messages < 1:
            raise ValueError("max_connections and client_buffer_messages must be >= 1")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("an auth token must not be empty")


@dataclass
class ApiOptions:
    """How the front end reaches the engine, whom it serves, and the limits it holds every client to."""

    address: str
    api_key: str | None = None
    served_model_name: str | None = None  # default: the checkpoint directory's name
    engine_timeout: float = 30.0  # an open stream's engine may stay silent this long
    ping_timeout: float = 2.0  # a liveness check (a new request after quiet stats, /health) waits this long
    host: str = "127.0.0.1"  # where the API listens (a request's Host must name it when there is no key)
    port: int = 8000
    max_body_bytes: int = 2 << 20  # a larger request body is refused (413) before it is read
    read_timeout: float = 10.0  # a request's headers and body must have arrived within this many seconds
    max_http_connections: int = 1024  # open HTTP connections; fewer if the open-file limit asks for it
    drain_timeout: int = 30  # on SIGTERM, requests in flight get this many seconds before they are cut

    def __post_init__(self) -> None:
        if min(self.engine_timeout, self.ping_timeout, self.read_timeout) <= 0 or self.drain_timeout < 0:
            raise ValueError("the timeouts must be > 0 (the drain timeout >= 0)")
        if self.max_body_bytes < 1024 or self.max_http_connections < 1:
            raise ValueError("max_body_bytes must be >= 1024 and max_http_connections >= 1")
