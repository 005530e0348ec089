"""The OpenAI-compatible routes (FastAPI). The engine is reached only through `AsyncEngineClient`.

One shared client per app multiplexes every HTTP request over one engine connection (as the console
does); the engine loop knows nothing about HTTP. The layout: edge.py checks every connection and request
before a route sees it (API key, Host, body size, timeouts), schemas.py turns a body into engine
requests, generation.py runs them, reply.py turns their outputs into choices (shapes.py: each
endpoint's dress), errors.py words every error as OpenAI does, state.py holds what the app shares, models.py
picks the engine a request's `model` names (the one engine, or a catalogue's, loaded on demand), and this module
routes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.service.client import AsyncEngineClient
from engine.service.http import messages as messages_api
from engine.service.http import responses as responses_api
from engine.service.http.edge import EdgeGuard
from engine.service.http.errors import ApiError, validation_error
from engine.service.http.generation import ClientGone, respond
from engine.service.http.messages.schemas import MessagesInput, MessagesRequest
from engine.service.http.metrics import CONTENT_TYPE, Metrics, endpoint_label
from engine.service.http.models import Leased, ModelRouter, OneModel, RouterCollector
from engine.service.http.responses.schemas import ResponsesRequest
from engine.service.http.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from engine.service.http.shapes import CHAT, COMPLETION
from engine.service.http.state import ApiState, engine_call
from engine.service.options import ApiOptions

__all__ = ["ApiOptions", "create_app"]


def create_app(options: ApiOptions, router: ModelRouter | None = None) -> FastAPI:
    """The FastAPI app for one engine address, or for a catalogue's engines (`router`), behind the edge's checks
    (edge.py: every route, the docs and /openapi.json included, needs the API key when there is one; /health never
    does)."""
    api_metrics = Metrics(engine=router is None)
    if router is not None:
        api_metrics.registry.register(RouterCollector(router))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if router is not None:
            app.state.models = router
            try:
                yield
            finally:
                await router.close()
            return
        client = AsyncEngineClient(options.address, timeout=options.engine_timeout)
        state = ApiState(options, client, api_metrics)
        app.state.models = OneModel(state)
        watcher = asyncio.create_task(state.watch_stats())
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
    if router is not None:
        _add_catalogue_routes(app, router, api_metrics)
    else:
        _add_one_model_routes(app, options)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        """vLLM's: the prompt's token ids as a generation request of it would count them."""
        async def run(state: ApiState) -> dict[str, Any]:
            await state.check_model(body.model)
            await state.require_engine()
            ids = await engine_call(state.client.tokenize(body.target(),
                                                          add_generation_prompt=body.add_generation_prompt))
            return {"count": len(ids), "max_model_len": (await state.info()).max_seq_len, "tokens": ids}

        return await leased(request, body.model, body.keep_alive, run)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        async def run(state: ApiState) -> dict[str, Any]:
            await state.check_model(body.model)
            await state.require_engine()
            return {"prompt": await engine_call(state.client.detokenize(body.tokens))}

        return await leased(request, body.model, body.keep_alive, run)

    return app


def _add_one_model_routes(app: FastAPI, options: ApiOptions) -> None:
    """/health, /v1/models and /metrics of the one engine."""

    def state(request: Request) -> ApiState:
        return request.app.state.models.state

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        """Liveness: the engine answers a ping. Open without the API key, so it tells nothing else."""
        one = state(request)
        one.check_connection()
        await engine_call(one.client.ping(timeout=options.ping_timeout))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [await state(request).model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        await state(request).check_model(model_id)
        return await state(request).model_card()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(state(request).metrics.render(), media_type=CONTENT_TYPE)


def _add_catalogue_routes(app: FastAPI, router: ModelRouter, api_metrics: Metrics) -> None:
    """/health (the front itself), /v1/models (the whole catalogue, loaded or not), the admin load and unload, and
    /metrics: the catalogue's and the front's, or with ?model=ID that loaded model's engine's."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": await router.cards()}

    @app.post("/v1/models/{model_id:path}/load")
    async def load(model_id: str) -> dict[str, Any]:
        await router.ensure(router.entry(model_id))
        return await router.card(model_id)

    @app.post("/v1/models/{model_id:path}/unload")
    async def unload(model_id: str) -> dict[str, Any]:
        await router.unload(model_id)
        return await router.card(model_id)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return await router.card(model_id)

    @app.get("/metrics")
    async def metrics(model: str | None = None) -> Response:
        if model is None:
            return Response(api_metrics.render(), media_type=CONTENT_TYPE)
        state = router.state_of(model)
        if state is None:
            raise ApiError(404, f"model {model} is not loaded", param="model", code="model_not_loaded")
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def leased(request: Request, model: str | None, keep_alive: float | None,
                 run: Callable[[ApiState], Awaitable[Response | dict[str, Any]]]) -> Response:
    """`run` on the engine of the model the body names, held for as long as its response is being sent."""
    lease = await request.app.state.models.lease(model, keep_alive)
    try:
        result = await run(lease.state)
    except BaseException:
        lease.release()
        raise
    if isinstance(result, Response):
        return Leased(result, lease)
    lease.release()
    return JSONResponse(result)


def _add_generation_routes(app: FastAPI) -> None:
    """The routes that generate: OpenAI's chat and completions (generation.py), Anthropic's Messages API
    (messages/) and OpenAI's Responses API (responses/)."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await leased(request, body.model, body.keep_alive, lambda s: respond(s, request, body, CHAT))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await leased(request, body.model, body.keep_alive, lambda s: respond(s, request, body, COMPLETION))

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await leased(request, body.model, body.keep_alive, lambda s: messages_api.respond(s, request, body))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesInput, request: Request) -> Response:
        return await leased(request, body.model, body.keep_alive, lambda s: messages_api.count_tokens(s, body))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await leased(request, body.model, body.keep_alive, lambda s: responses_api.respond(s, request, body))


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
