"""Clients for the engine process: `EngineClient` (blocking) and `AsyncEngineClient` (asyncio).

Both speak the protocol in docs/protocol.md over one DEALER socket, so many requests can stream at
once over one connection, and read live stats from the engine's PUB socket. Neither imports torch,
so a TUI or a load generator starts fast.

    with EngineClient() as client:                     # default per-user ipc address
        for out in client.generate("Once upon a time", max_tokens=32):
            print(out.text, end="", flush=True)        # out is a Delta, and lastly a Final
        print(client.stats().counters)

    async with AsyncEngineClient(address) as client:
        async for out in client.generate([{"role": "user", "content": "hi"}], temperature=0.7):
            ...

Closing a `generate` iterator before its Final (break, task cancellation) aborts the request, so
an abandoned stream never keeps generating. A lost connection (the engine stopped or died) raises
`EngineUnavailable` in every waiting call at once, not at the end of its timeout. An engine started
with `--auth-token` needs the same token: pass `auth_token=` or set MINICHAT_AUTH_TOKEN.

Layout: core.py is the protocol (what to send, where a reply goes, when a stream is over, how a
failure reaches the waiters) and does no I/O; blocking.py and aio.py are the two transports over it;
sockets.py opens the sockets both use.
"""

from engine.service.client.aio import AsyncEngineClient
from engine.service.client.blocking import EngineClient, probe
from engine.service.client.core import (
    AUTH_ENV,
    AUTH_USER,
    EngineError,
    EngineRefused,
    EngineUnavailable,
    resolve_auth_token,
)

__all__ = ["AUTH_ENV", "AUTH_USER", "AsyncEngineClient", "EngineClient", "EngineError", "EngineRefused",
           "EngineUnavailable", "probe", "resolve_auth_token"]
