"""ServerOptions: the engine process's limits and access rules, on top of EngineConfig's engine limits."""

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
    client_buffer_messages: int = 1000

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1 or self.max_message_bytes < 1024:
            raise ValueError("max_waiting_requests must be >= 1 and max_message_bytes >= 1024")
        if self.max_connections < 1 or self.client_buffer_messages < 1:
            raise ValueError("max_connections and client_buffer_messages must be >= 1")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("an auth token must not be empty")
