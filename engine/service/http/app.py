"""The OpenAI-compatible routes (FastAPI). The engine is reached only through `AsyncEngineClient`.

One shared client per app multiplexes every HTTP request over one engine connection (as the console
does); the engine loop knows nothing about HTTP. A client that goes away aborts its engine request at
once: before the first output by racing the engine against `http.disconnect`, while streaming by
closing the stream (Starlette cancels a response whose client left, and `_EventStream` then closes
the generator, whose `finally` sends the abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from engine.outputs import Final, Output
from engine.params import InvalidParams, SamplingParams
from engine.prompt import Prompt
from engine.service.client import AsyncEngineClient, EngineError, EngineUnavailable
from engine.service.http.metrics import CONTENT_TYPE, Metrics, RequestTimer
from engine.service.http.schemas import ChatCompletionRequest, CompletionRequest, Sampling, error_body
from engine.service.protocol import Info

log = logging.getLogger("minichat.http")
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


class ApiError(Exception):
    """An error answered with an OpenAI-style body and `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status, headers=headers)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready; its engine request was aborted."""


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
        """503 at once when the engine is gone, instead of submitting into a silent socket: its stats stream
        is the cheap sign of life, and a ping decides when that has been quiet for a moment."""
        if not self.metrics.engine.fresh(1.0):
            await engine_call(self.client.ping(timeout=2.0))

    async def model_name(self) -> str:
        return self.options.served_model_name or Path((await self.info()).model).name

    async def check_model(self, requested: str | None) -> str:
        name = await self.model_name()
        if requested not in (None, name, (await self.info()).model):
            raise ApiError(404, f"The model `{requested}` does not exist; this server serves `{name}`.",
                           param="model", code="model_not_found")
        return name


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


def sampling(body: Sampling, default_max_tokens: int) -> SamplingParams:
    """The body's sampling parameters; a 400 in the engine's words for values it cannot use."""
    try:
        return body.params(default_max_tokens)
    except InvalidParams as e:
        raise ApiError(400, str(e), code="invalid_params") from e


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, unless the client disconnects first: then it is cancelled (an engine stream's
    cancellation aborts its request) and ClientGone is raised."""
    work = asyncio.ensure_future(awaitable)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (server shutdown): never leave `work` running
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientGone
    return work.result()


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (client gone included)."""

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def usage_body(final: Final) -> dict[str, Any]:
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


@dataclass
class Generation:
    """One HTTP generation request on its way through the engine, with its timing and accounting."""

    state: ApiState
    endpoint: str
    outputs: AsyncGenerator[Output, None]
    timer: RequestTimer
    final: Final | None = None

    @classmethod
    async def start(cls, state: ApiState, request: Request, endpoint: str, prompt: Prompt,
                    params: SamplingParams) -> Generation:
        """Submit, and wait for the first output: a refusal (bad prompt, too long) is still an HTTP error then."""
        timer = RequestTimer(state.metrics)
        outputs = state.client.generate(prompt, params, rid=f"http-{uuid.uuid4().hex[:16]}")
        try:
            await state.require_engine()
            first = await unless_disconnected(request, engine_call(anext(outputs)))
        except ApiError as e:
            state.metrics.requests.labels(endpoint, str(e.status)).inc()
            raise
        except ClientGone:
            state.metrics.requests.labels(endpoint, "abort").inc()
            raise
        return cls(state, endpoint, _prepend(first, outputs), timer)

    async def stream(self) -> AsyncGenerator[Output, None]:
        """Outputs up to the Final; an engine that vanishes mid-stream just ends it (headers are gone).
        Closing this generator early aborts the engine request."""
        try:
            async for out in self.outputs:
                if out.token_ids:
                    self.timer.tokens()
                if isinstance(out, Final):
                    self.final = out
                yield out
        except (EngineUnavailable, EngineError) as e:
            log.warning("stream ended by the engine: %s", e)
        finally:
            await self.outputs.aclose()
            self._account()

    def _account(self) -> None:
        m = self.state.metrics
        if self.final is None:
            m.requests.labels(self.endpoint, "abort").inc()
            return
        self.timer.done()
        m.requests.labels(self.endpoint, self.final.finish_reason).inc()
        m.prompt_tokens.inc(self.final.usage.prompt_tokens)
        m.generation_tokens.inc(self.final.usage.completion_tokens)

    async def collect(self, request: Request) -> tuple[str, Final]:
        """The whole output (aborted if the client leaves meanwhile)."""
        async def drain() -> str:
            async with contextlib.aclosing(self.stream()) as outputs:
                return "".join([out.text async for out in outputs])

        text = await unless_disconnected(request, drain())
        if self.final is None:
            raise ApiError(503, "the engine stopped answering mid-request", "server_error", code="engine_unavailable")
        return text, self.final


async def _prepend(first: Output, rest: AsyncGenerator[Output, None]) -> AsyncGenerator[Output, None]:
    try:
        yield first
        if not isinstance(first, Final):
            async for out in rest:
                yield out
    finally:
        await rest.aclose()


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
        state = api(request)
        info = await state.info()
        return {"object": "list", "data": [{"id": await state.model_name(), "object": "model",
                                            "created": state.created, "owned_by": "minichat",
                                            "root": info.model, "max_model_len": info.max_seq_len}]}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(api(request).metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state = api(request)
        model = await state.check_model(body.model)
        params = sampling(body, (await state.info()).max_seq_len)
        gen = await Generation.start(state, request, "chat", body.chat(), params)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return _EventStream(_chat_events(gen, rid, created, model, _include_usage(body)))
        text, final = await gen.collect(request)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": final.finish_reason}],
            "usage": usage_body(final)})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state = api(request)
        model = await state.check_model(body.model)
        gen = await Generation.start(state, request, "completions", body.prompt, sampling(body, 16))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return _EventStream(_completion_events(gen, rid, created, model, _include_usage(body)))
        text, final = await gen.collect(request)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": final.finish_reason}],
            "usage": usage_body(final)})

    return app


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


async def _chat_events(gen: Generation, rid: str, created: int, model: str,
                       include_usage: bool) -> AsyncGenerator[str, None]:
    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        return body | {"usage": None} if include_usage else body

    yield sse(chunk({"role": "assistant", "content": ""}))
    async with contextlib.aclosing(gen.stream()) as outputs:
        async for out in outputs:
            if out.text:
                yield sse(chunk({"content": out.text}))
            if isinstance(out, Final):
                yield sse(chunk({}, out.finish_reason))
                if include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": usage_body(out)})
    yield sse("[DONE]")


async def _completion_events(gen: Generation, rid: str, created: int, model: str,
                             include_usage: bool) -> AsyncGenerator[str, None]:
    def chunk(text: str, finish_reason: str | None = None) -> dict[str, Any]:
        body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
        return body | {"usage": None} if include_usage else body

    async with contextlib.aclosing(gen.stream()) as outputs:
        async for out in outputs:
            if isinstance(out, Final):
                yield sse(chunk(out.text, out.finish_reason))
                if include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": usage_body(out)})
            elif out.text:
                yield sse(chunk(out.text))
    yield sse("[DONE]")


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
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return ApiError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return ApiError(e.status_code, str(e.detail), code=None).response()

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the engine request is already aborted

    @app.exception_handler(Exception)
    async def bug(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return ApiError(500, "internal error in the HTTP front end (see its log)", "server_error",
                        code="internal").response()

