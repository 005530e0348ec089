"""The OpenAI-compatible routes (FastAPI). The engine is reached only through `AsyncEngineClient`.

One shared client per app multiplexes every HTTP request over one engine connection (as the console
does); the engine loop knows nothing about HTTP. The layout: edge.py checks every connection and request
before a route sees it (API key, Host, body size, timeouts), schemas.py turns a body into engine
requests, generation.py runs them, reply.py turns their outputs into choices (shapes.py: each
endpoint's dress), errors.py words every error as OpenAI does, state.py holds what the app shares, and
this module routes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.service.client import AsyncEngineClient, EngineUnavailable
from engine.service.http import messages as messages_api
from engine.service.http import responses as responses_api
from engine.service.http.edge import EdgeGuard
from engine.service.http.errors import ApiError, validation_error
from engine.service.http.generation import ClientGone, respond
from engine.service.http.messages.schemas import MessagesInput, MessagesRequest
from engine.service.http.metrics import CONTENT_TYPE, Metrics, endpoint_label
from engine.service.http.responses.schemas import ResponsesRequest
from engine.service.http.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from engine.service.http.shapes import CHAT, COMPLETION
from engine.service.http.state import ApiState, engine_call
from engine.service.options import ApiOptions

__all__ = ["ApiOptions", "create_app"]


def create_app(options: ApiOptions) -> FastAPI:
    """The FastAPI app for one engine address, behind the edge's checks (edge.py: every route, the docs and
    /openapi.json included, needs the API key when there is one; /health never does)."""
    api_metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncEngineClient(options.address, timeout=options.engine_timeout)
        app.state.api = state = ApiState(options, client, api_metrics)
        watcher = asyncio.create_task(_watch_stats(state))
        try:
            yield
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await state.close()
            await client.close()

    app = FastAPI(title="minichat", lifespan=lifespan)
    app.add_middleware(EdgeGuard, options=options, metrics=api_metrics)
    _install_error_handlers(app, api_metrics)
    _add_generation_routes(app)
    api = _api

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        """Liveness: the engine answers a ping. Open without the API key, so it tells nothing else."""
        state = api(request)
        state.check_connection()
        await engine_call(state.client.ping(timeout=options.ping_timeout))
        return {"status": "ok"}

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


def _api(request: Request) -> ApiState:
    return request.app.state.api


def _add_generation_routes(app: FastAPI) -> None:
    """The routes that generate: OpenAI's chat and completions (generation.py), Anthropic's Messages API
    (messages/) and OpenAI's Responses API (responses/)."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(_api(request), request, body, CHAT)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(_api(request), request, body, COMPLETION)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await messages_api.respond(_api(request), request, body)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesInput, request: Request) -> dict[str, int]:
        return await messages_api.count_tokens(_api(request), body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await responses_api.respond(_api(request), request, body)


async def _watch_stats(state: ApiState) -> None:
    """Keep the metrics' engine snapshot fresh; an absent engine just leaves it stale until it is back.
    Stats arriving while the engine connection is known lost mean an engine answers again: a ping over
    that connection ends the loss, so requests are not refused for longer than it takes."""
    while True:
        try:
            async for snap in state.client.watch_stats(timeout=2.0):
                state.metrics.engine.update(snap)
                if not state.metrics.model_name:  # vLLM's label: the name clients ask for
                    with contextlib.suppress(ApiError):  # no Info yet: the next snapshot asks again
                        state.metrics.model_name = await state.model_name()
                if state.client.connection_lost:
                    state.probe()
        except EngineUnavailable:
            continue


def _install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error as an OpenAI-style body, counted by endpoint and status; never a stack trace (a bug's
    500 is edge.py's)."""

    def answer(request: Request, error: ApiError) -> JSONResponse:
        metrics.requests.labels(endpoint_label(request.url.path), str(error.status)).inc()
        return error.response(request.url.path)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return answer(request, e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return answer(request, validation_error(e.errors(), e.body))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return answer(request, ApiError(e.status_code, str(e.detail), code=None))

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the engine requests are already aborted
