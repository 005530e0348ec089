"""What one app holds (the engine client, the engine's info, the metrics) and how an engine call's
failures become OpenAI-style errors; shared by the routes (app.py) and the generations (generation.py)."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from engine.service.client import AsyncEngineClient, EngineError, EngineUnavailable
from engine.service.http.errors import ApiError
from engine.service.http.metrics import Metrics
from engine.service.protocol import Info

T = TypeVar("T")

# engine error code -> HTTP status; anything else is our bug or the engine's (500)
ENGINE_STATUS = {"invalid_request": 400, "invalid_params": 400, "prompt_too_long": 400, "bad_message": 400,
                 "overloaded": 503}


@dataclass
class ApiOptions:
    """How the front end reaches the engine and whom it serves."""

    address: str
    api_key: str | None = None
    served_model_name: str | None = None  # default: the checkpoint directory's name
    engine_timeout: float = 30.0


@dataclass
class ApiState:
    """Everything one app holds: the engine client, the engine's info once known, the metrics."""

    options: ApiOptions
    client: AsyncEngineClient
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    _info: Info | None = None

    async def info(self) -> Info:
        """The engine's Info, asked once (503 while the engine does not answer)."""
        if self._info is None:
            self._info = await engine_call(self.client.info(timeout=5.0))
        return self._info

    async def require_engine(self) -> None:
        """503 at once when the engine is gone, instead of sending into a silent socket: its stats stream
        is the cheap sign of life, and a ping decides when that has been quiet for a moment."""
        if not self.metrics.engine.fresh(1.0):
            await engine_call(self.client.ping(timeout=2.0))

    async def model_name(self) -> str:
        return self.options.served_model_name or Path((await self.info()).model).name

    async def check_model(self, requested: str | None) -> str:
        """The served model's id; 404 in OpenAI's shape for another one (the checkpoint path also names it)."""
        name = await self.model_name()
        if requested not in (None, name, (await self.info()).model):
            raise ApiError(404, f"The model `{requested}` does not exist; this server serves `{name}`.",
                           param="model", code="model_not_found")
        return name

    async def model_card(self) -> dict[str, Any]:
        """The served model as /v1/models lists it (with vLLM's `root` and `max_model_len`)."""
        info = await self.info()
        return {"id": await self.model_name(), "object": "model", "created": self.created, "owned_by": "minichat",
                "root": info.model, "max_model_len": info.max_seq_len}


async def engine_call(awaitable: Awaitable[T]) -> T:
    """Await an engine call, turning its failures into OpenAI-style errors."""
    try:
        return await awaitable
    except EngineUnavailable as e:
        raise ApiError(503, f"the engine is not answering: {e}", "server_error", code="engine_unavailable") from e
    except EngineError as e:
        status = ENGINE_STATUS.get(e.code, 500)
        raise ApiError(status, e.message, "invalid_request_error" if status == 400 else "server_error",
                       code=e.code) from e
