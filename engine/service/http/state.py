"""What one app holds (the engine client, the engine's info, the metrics) and how an engine call's
failures become OpenAI-style errors; shared by the routes (app.py) and the generations (generation.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.config import model_id
from engine.service.client import AsyncEngineClient, EngineError, EngineUnavailable
from engine.service.http.errors import ApiError
from engine.service.http.metrics import Metrics
from engine.service.options import ApiOptions
from engine.service.protocol import Info

T = TypeVar("T")
MODEL_CARD = ("family", "architecture", "experts", "window")
"""What /v1/models tells of the model beyond vLLM's fields (the engine's `model_info`)."""

# engine error code -> HTTP status; anything else is our bug or the engine's (500)
ENGINE_STATUS = {"invalid_request": 400, "invalid_params": 400, "invalid_grammar": 400, "prompt_too_long": 400,
                 "bad_message": 400, "too_large": 413, "overloaded": 503}


@dataclass
class ApiState:
    """Everything one app holds: the engine client, the engine's info once known, the metrics."""

    options: ApiOptions
    client: AsyncEngineClient
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    _info: Info | None = None
    _probe: asyncio.Task[None] | None = None

    async def info(self) -> Info:
        """The engine's Info, asked once (503 while the engine does not answer)."""
        if self._info is None:
            self._info = await engine_call(self.client.info(timeout=5.0))
        return self._info

    async def require_engine(self) -> None:
        """503 at once when the engine is gone, instead of sending into a silent socket: the client saw its
        connection break (and heard nothing since), or the stats stream, the cheap sign of life, has been
        quiet for a moment and a ping goes unanswered."""
        self.check_connection()
        if not self.metrics.engine.fresh(1.0):
            await engine_call(self.client.ping(timeout=self.options.ping_timeout))

    def check_connection(self) -> None:
        """503 while the engine's connection is known lost; a ping in the background (one at a time) finds
        out when the engine is back, since a reply of any kind ends the loss."""
        if not self.client.connection_lost:
            return
        self.probe()
        raise ApiError(503, f"the engine at {self.options.address} closed the connection (it stopped or died, or "
                            f"refused this front end's auth token) and has not answered since", "server_error",
                       code="engine_unavailable")

    def probe(self) -> None:
        """Ping the engine in the background unless a ping is out already."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._ping_quietly())

    async def _ping_quietly(self) -> None:
        with contextlib.suppress(EngineUnavailable, EngineError):
            await self.client.ping(timeout=self.options.ping_timeout)

    async def watch_stats(self) -> None:
        """Keep the metrics' engine snapshot fresh (run as a task for the app's life); an absent engine just leaves it
        stale until it is back. Stats arriving while the engine connection is known lost mean an engine answers
        again: a ping over that connection ends the loss, so requests are not refused for longer than it takes."""
        while True:
            try:
                async for snap in self.client.watch_stats(timeout=2.0):
                    self.metrics.engine.update(snap)
                    if not self.metrics.model_name:  # vLLM's label: the name clients ask for
                        with contextlib.suppress(ApiError):  # no Info yet: the next snapshot asks again
                            self.metrics.model_name = await self.model_name()
                    if self.client.connection_lost:
                        self.probe()
            except EngineUnavailable:
                continue

    async def close(self) -> None:
        """Stop the background ping, if any (the client is closed by its owner)."""
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)

    async def model_name(self) -> str:
        return self.options.served_model_name or model_id((await self.info()).model)

    async def check_model(self, requested: str | None) -> str:
        """The served model's id; 404 in OpenAI's shape for another one (the checkpoint path also names it)."""
        name = await self.model_name()
        if requested not in (None, name, (await self.info()).model):
            raise ApiError(404, f"The model `{str(requested)[:200]}` does not exist; this server serves `{name}`.",
                           param="model", code="model_not_found")
        return name

    async def model_card(self) -> dict[str, Any]:
        """The served model as /v1/models lists it (with vLLM's `root` and `max_model_len`, and what it is: family,
        experts, window)."""
        info = await self.info()
        return {"id": await self.model_name(), "object": "model", "created": self.created, "owned_by": "minichat",
                "root": info.model, "max_model_len": info.max_seq_len, "weights": info.execution.get("weights"),
                "cpu_kernels": info.execution.get("cpu_kernels"),
                **{k: v for k, v in info.model_info.items() if k in MODEL_CARD}}


async def engine_call(awaitable: Awaitable[T]) -> T:
    """Await an engine call, turning its failures into OpenAI-style errors."""
    try:
        return await awaitable
    except (EngineUnavailable, EngineError) as e:
        raise api_error(e) from e


def api_error(e: EngineUnavailable | EngineError) -> ApiError:
    """An engine call's failure as the OpenAI-style error it answers."""
    if isinstance(e, EngineUnavailable):
        return ApiError(503, f"the engine is not answering: {e}", "server_error", code="engine_unavailable")
    status = ENGINE_STATUS.get(e.code, 500)
    return ApiError(status, e.message, "invalid_request_error" if status < 500 else "server_error", code=e.code)
