"""The OpenAI-compatible routes (FastAPI). The engine is reached only through `AsyncEngineClient`.

One shared client per app multiplexes every HTTP request over one engine connection (as the console
does); the engine loop knows nothing about HTTP. The layout: schemas.py turns a body into engine
requests, generation.py runs them and turns their outputs into choices, errors.py words every error
as OpenAI does, state.py holds what the app shares, and this module routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.service.client import AsyncEngineClient, EngineUnavailable
from engine.service.http.errors import ApiError, validation_error
from engine.service.http.generation import CHAT, COMPLETION, ClientGone, respond
from engine.service.http.metrics import CONTENT_TYPE
from engine.service.http.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from engine.service.http.state import ApiOptions, ApiState, engine_call

__all__ = ["ApiOptions", "create_app"]

log = logging.getLogger("minichat.http")


def create_app(options: ApiOptions) -> FastAPI:
    """The FastAPI app for one engine address."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncEngineClient(options.address, timeout=options.engine_timeout)
        app.state.api = state = ApiState(options, client)
        watcher = asyncio.create_task(_watch_stats(state))
        try:
            yield
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await client.close()

    async def authorize(request: Request) -> None:
        if options.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), options.api_key.encode()):
            raise ApiError(401, "Missing or incorrect API key; send `Authorization: Bearer <key>`.",
                           code="invalid_api_key")

    app = FastAPI(title="minichat", lifespan=lifespan, dependencies=[Depends(authorize)])
    _install_error_handlers(app)

    def api(request: Request) -> ApiState:
        return request.app.state.api

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        pong = await engine_call(api(request).client.ping(timeout=2.0))
        return {"status": "ok", "engine_version": pong.version}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [await api(request).model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        state = api(request)
        await state.check_model(model_id)
        return await state.model_card()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(api(request).metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(api(request), request, body, CHAT)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(api(request), request, body, COMPLETION)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
        """vLLM's: the prompt's token ids as a generation request of it would count them."""
        state = api(request)
        await state.check_model(body.model)
        await state.require_engine()
        ids = await engine_call(state.client.tokenize(body.target(), add_generation_prompt=body.add_generation_prompt))
        return {"count": len(ids), "max_model_len": (await state.info()).max_seq_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
        state = api(request)
        await state.check_model(body.model)
        await state.require_engine()
        return {"prompt": await engine_call(state.client.detokenize(body.tokens))}

    return app


async def _watch_stats(state: ApiState) -> None:
    """Keep the metrics' engine snapshot fresh; an absent engine just leaves it stale until it is back."""
    while True:
        try:
            async for snap in state.client.watch_stats(timeout=2.0):
                state.metrics.engine.update(snap)
        except EngineUnavailable:
            continue


def _install_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style body; never a stack trace."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(e.errors(), e.body).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return ApiError(e.status_code, str(e.detail), code=None).response()

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the engine requests are already aborted

    @app.exception_handler(Exception)
    async def bug(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return ApiError(500, "internal error in the HTTP front end (see its log)", "server_error",
                        code="internal").response()
