"""Generation requests from body to response: a body's engine requests (schemas.py) run concurrently
through the engine (they batch there), and their outputs become the response's choices, whole or
streamed as server-sent events, with the usage summed over them. The machinery (`prepare`, `start_all`,
`collect`, `pieces`, `EventStream`) serves every API; `respond` is chat's and completions', and
anthropic.py and responses.py dress the same pieces as their APIs do.

A client that goes away aborts its engine requests at once: before the first outputs by racing the
engine against `http.disconnect`, while streaming by closing the streams (Starlette cancels a response
whose client left, and `_EventStream` then closes the generators, whose `finally` sends the aborts).

A stream the engine cuts off (it died, its connection dropped) ends with an error event in OpenAI's shape
and no `data: [DONE]`, so no client takes the part it got for a whole reply.

An engine request with `n` choices streams them all (each output names its `index`); a choice ends
at its Delta's `finish_reason` or at the request's Final. Whole or streamed, the outputs go through the
same `Reply` (reply.py: one writer per choice, echo and tool calls included), dressed per endpoint
(shapes.py): a whole reply is everything fed, then finished; a stream sends each output's pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from engine.outputs import Final, Output
from engine.params import InvalidParams
from engine.prompt import is_chat, is_token_ids
from engine.service.client import EngineError, EngineUnavailable
from engine.service.http.errors import ApiError, error_body
from engine.service.http.metrics import RequestTimer
from engine.service.http.reply import Piece, Reply, Tally
from engine.service.http.schemas import EngineRequest, GenerationRequest
from engine.service.http.shapes import Shape
from engine.service.http.state import ApiState, api_error, engine_call
from engine.service.protocol import MAX_CLIENT_LABEL, Info
from engine.structured import InvalidGrammar
from engine.tools import ToolFormat

log = logging.getLogger("minichat.http")
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready; its engine requests were aborted."""


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


async def all_of(awaitables: Iterable[Awaitable[T]], undo: Callable[[T], Awaitable[None]] | None = None) -> list[T]:
    """Their results, run concurrently. When one fails (or this is cancelled) the others are cancelled,
    those already done are undone, and the failure is raised: nothing is left running."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if undo is not None and not isinstance(result, BaseException):
                await undo(result)
        raise


@dataclass
class Generation:
    """One engine request of an HTTP request on its way through the engine, with its timing and accounting.
    `index` is the choice it fills; `prompt_tokens` is known before the Final when the prompt went as ids."""

    state: ApiState
    endpoint: str
    index: int
    outputs: AsyncGenerator[Output, None]
    timer: RequestTimer
    prompt_tokens: int | None
    final: Final | None = None
    cut: bool = False  # the engine failed before the Final

    @classmethod
    async def start(cls, state: ApiState, endpoint: str, req: EngineRequest, count_prompt: bool,
                    client: str) -> Generation:
        """Submit, and wait for the first output: a refusal (bad prompt, too long) is still an HTTP error then.
        With `count_prompt` (the prompt's length is needed before its Final) a text or chat prompt is
        tokenized by the engine first and submitted as those ids, so it is still tokenized only once.
        `client` labels the engine request for its operators (`client_label`)."""
        timer = RequestTimer(state.metrics)
        prompt = req.prompt
        if count_prompt and (isinstance(prompt, str) or is_chat(prompt)):
            prompt = await engine_call(state.client.tokenize(prompt, tools=req.tools,
                                                             template_kwargs=req.template_kwargs))
        outputs = state.client.generate(prompt, req.params, rid=f"http-{uuid.uuid4().hex[:16]}", tools=req.tools,
                                        client=client, template_kwargs=req.template_kwargs)
        first = await engine_call(anext(outputs))
        return cls(state, endpoint, req.index, _prepend(first, outputs), timer,
                   len(prompt) if is_token_ids(prompt) else None)

    async def stream(self) -> AsyncGenerator[Output, None]:
        """Outputs up to the Final; ApiError when the engine fails before it (it vanished, or refused the
        request mid-way). Closing this generator early aborts the engine request."""
        try:
            async for out in self.outputs:
                if out.token_ids:
                    self.timer.tokens()
                if isinstance(out, Final):
                    self.final = out
                yield out
        except (EngineUnavailable, EngineError) as e:
            log.warning("stream cut by the engine: %s", e)
            self.cut = True
            raise api_error(e) from e
        finally:
            await self.outputs.aclose()
            self._account()

    async def collect(self) -> list[Output]:
        """Every output, up to the Final."""
        async with contextlib.aclosing(self.stream()) as outputs:
            return [out async for out in outputs]

    async def close(self) -> None:
        """Abort the engine request unless it is over (nothing happens to a finished or closed one)."""
        await self.outputs.aclose()

    def _account(self) -> None:
        m = self.state.metrics
        if self.final is None:
            m.requests.labels(self.endpoint, "cut" if self.cut else "abort").inc()
            return
        self.timer.done()
        m.requests.labels(self.endpoint, self.final.finish_reason).inc()
        m.finished(self.final)


async def _prepend(first: Output, rest: AsyncGenerator[Output, None]) -> AsyncGenerator[Output, None]:
    try:
        yield first
        if not isinstance(first, Final):
            async for out in rest:
                yield out
    finally:
        await rest.aclose()


def client_label(request: Request) -> str:
    """Who sent an engine request, as the engine's operators see it: the HTTP client and the endpoint,
    e.g. `http 127.0.0.1 POST /v1/chat/completions`."""
    peer = f" {request.client.host}" if request.client is not None else ""
    return f"http{peer} {request.method} {request.url.path}"[:MAX_CLIENT_LABEL]


async def start_all(state: ApiState, request: Request, endpoint: str, requests: list[EngineRequest],
                    count_prompt: bool) -> list[Generation]:
    """Submit every engine request of one HTTP request at once and wait for each one's first output; one
    refusal, or the client leaving, aborts them all (a refusal is counted in the metrics where it is
    answered, by the app's error handlers)."""
    try:
        await state.require_engine()
        client = client_label(request)
        starts = (Generation.start(state, endpoint, req, count_prompt, client) for req in requests)
        return await unless_disconnected(request, all_of(starts, undo=Generation.close))
    except ClientGone:
        state.metrics.requests.labels(endpoint, "abort").inc()
        raise


async def merged(generations: list[Generation]) -> AsyncGenerator[tuple[Generation, Output], None]:
    """Every generation's outputs as they come, each with its generation. Closing this closes them all,
    which aborts the unfinished ones."""
    if len(generations) == 1:  # no tasks needed
        async with contextlib.aclosing(generations[0].stream()) as outputs:
            async for out in outputs:
                yield generations[0], out
        return
    queue: asyncio.Queue[tuple[Generation, Output] | ApiError | None] = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        try:
            async with contextlib.aclosing(gen.stream()) as outputs:
                async for out in outputs:
                    queue.put_nowait((gen, out))
        except ApiError as e:  # the engine cut this one off: raised to the reader, which ends them all
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)  # this one is over

    tasks = [asyncio.create_task(pump(gen)) for gen in generations]
    try:
        for _ in tasks:
            while (item := await queue.get()) is not None:
                if isinstance(item, ApiError):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class Envelope:
    """What every response and chunk of one HTTP request starts with."""

    id: str
    created: int
    model: str

    def of(self, object_: str, **fields: Any) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model, **fields}


class Body(Protocol):
    """A generation request's body, in any API's shape (schemas.py, anthropic.py, responses.py)."""

    model: str | None

    def engine_requests(self, info: Info) -> list[EngineRequest]:
        """The engine requests the body stands for; InvalidParams or InvalidGrammar for what the engine
        cannot honour, worded as a sentence that starts with the field's name."""
        ...


@dataclass(frozen=True)
class Prepared:
    """A body checked against the served model: its name, the engine's Info, the engine requests."""

    model: str
    info: Info
    requests: list[EngineRequest]

    @property
    def calls_in(self) -> ToolFormat | None:
        """The tool-call format to read the replies for (chat with tools), else None."""
        return cast("ToolFormat", self.info.tool_format) if self.requests[0].tools else None

    @property
    def one_call(self) -> bool:
        """A reply keeps its first tool call only (parallel calls switched off)."""
        return self.requests[0].one_call

    @property
    def reasoning(self) -> bool:
        """The replies' thinking is split off (the model has a think block)."""
        return self.requests[0].params.reasoning


async def prepare(state: ApiState, body: Body) -> Prepared:
    """The model named checked (404 for another) and the body's engine requests built; a 400 naming the
    field for values pydantic let through that the engine cannot use."""
    model = await state.check_model(body.model)
    info = await state.info()
    try:
        requests = body.engine_requests(info)
    except (InvalidParams, InvalidGrammar) as e:
        field = re.split(r"[ :]", str(e), maxsplit=1)[0]  # a sentence that starts with a field's name names it
        head = re.match(r"\w*", field)
        known = type(body).model_fields if isinstance(body, BaseModel) else {}
        raise ApiError(400, str(e), param=field if head and head.group() in known else None,
                       code="invalid_grammar" if isinstance(e, InvalidGrammar) else "invalid_params") from e
    return Prepared(model, info, requests)


async def collect(request: Request, generations: list[Generation], reply: Reply) -> None:
    """Feed `reply` every output of every generation (the client leaving aborts them)."""
    results = await unless_disconnected(request, all_of(gen.collect() for gen in generations))
    for gen, outputs in zip(generations, results, strict=True):
        for out in outputs:
            reply.feed(gen.index, out)


async def pieces(generations: list[Generation], reply: Reply) -> AsyncGenerator[tuple[int, Piece], None]:
    """Each choice's pieces as the engine sends them, with the choice's index; ApiError when the engine
    cuts the stream off (each API ends its stream with its own error event then)."""
    async with contextlib.aclosing(merged(generations)) as outputs:
        async for gen, out in outputs:
            index, added = reply.feed(gen.index, out)
            for piece in added:
                yield index, piece


async def respond(state: ApiState, request: Request, body: GenerationRequest, shape: Shape) -> Response:
    """One chat or completions request from body to response."""
    prepared = await prepare(state, body)
    requests = prepared.requests
    count_prompt = body.stream and body.usage_in_every_chunk
    echo = await _echo_texts(state, body, requests)
    generations = await start_all(state, request, shape.endpoint, requests, count_prompt)
    envelope = Envelope(f"{shape.id_prefix}-{uuid.uuid4().hex}", int(time.time()), prepared.model)
    reply = Reply({gen.index: gen.prompt_tokens for gen in generations}, echo, prepared.calls_in, prepared.one_call)
    if body.stream:
        chunks = Chunks(envelope, shape.chunk_object, reply.usage, every=body.usage_in_every_chunk,
                        at_end=body.usage_at_the_end, reasoning=prepared.reasoning)
        return EventStream(_events(generations, reply, shape, chunks, body.n), generations)
    await collect(request, generations, reply)
    choices = [shape.choice(index, whole, prepared.reasoning) for index, whole in reply.finish()]
    return JSONResponse(envelope.of(shape.object, choices=choices, usage=reply.usage.body(prepared.reasoning)))


async def _echo_texts(state: ApiState, body: GenerationRequest, requests: list[EngineRequest]) -> dict[int, str]:
    """With `echo`, each prompt's text by its first choice's index (token ids are detokenized by the engine)."""
    if not getattr(body, "echo", False):
        return {}
    texts = {}
    for req in requests:
        texts[req.index] = req.prompt if isinstance(req.prompt, str) else \
            await engine_call(state.client.detokenize(list(req.prompt)))  # type: ignore[arg-type]
    return texts


@dataclass(frozen=True)
class Chunks:
    """A stream's events: each choice piece in a chunk of its own, with the usage as `stream_options` asks
    (in `every` chunk, or `at_end` in a last chunk of its own), and the stream's end."""

    envelope: Envelope
    object: str
    usage: Tally
    every: bool
    at_end: bool
    reasoning: bool = False  # the usage counts reasoning tokens

    def of(self, choice: dict[str, Any]) -> str:
        fields: dict[str, Any] = {"choices": [choice]}
        if self.every:
            fields["usage"] = self.usage.body(self.reasoning)
        elif self.at_end:  # OpenAI's SDK expects the field in every chunk then, null until the last
            fields["usage"] = None
        return sse(self.envelope.of(self.object, **fields))

    def end(self) -> list[str]:
        """The usage chunk if asked for, then `[DONE]`."""
        if not self.at_end:
            return [sse("[DONE]")]
        return [sse(self.envelope.of(self.object, choices=[], usage=self.usage.body(self.reasoning))), sse("[DONE]")]


async def _events(generations: list[Generation], reply: Reply, shape: Shape, chunks: Chunks,
                  n: int) -> AsyncGenerator[str, None]:
    """The SSE stream: the `n` choices of each generation opened, then each output's pieces as the engine
    sends them, each in a chunk of its own, and the end; unless the engine cut the stream off: then an error
    event (OpenAI's shape, which its SDK raises) ends it, and no `[DONE]` (what came is not a whole reply)."""
    for gen in generations:
        for k in range(n):
            if (opening := shape.opening(gen.index + k)) is not None:
                yield chunks.of(opening)
    try:
        async with contextlib.aclosing(pieces(generations, reply)) as stream:
            async for index, piece in stream:
                yield chunks.of(shape.delta(index, piece))
    except ApiError as e:
        yield sse(error_body(e.message, e.type, e.param, e.code))
        return
    for event in chunks.end():
        yield event


def sse(payload: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event; `event` names its type (Anthropic's and the Responses API's streams do)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"event: {event}\ndata: {data}\n\n" if event is not None else f"data: {data}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose generations are closed however the response ends (client gone included,
    and before the events generator ever ran)."""

    def __init__(self, events: AsyncGenerator[str, None], generations: list[Generation]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events, self._generations = events, generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            for gen in self._generations:
                await gen.close()
