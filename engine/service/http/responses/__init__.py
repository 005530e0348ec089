"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it: the body (schemas.py) becomes one
engine request, run by the machinery the other routes use (generation.py) and read by the same choice
writer (reply.py), and its pieces are dressed as the API's output items: a `reasoning` item (the think
block as its `reasoning_text` content, and as its summary when `reasoning.summary` asks for one: this
engine writes no separate summary, so the summary is the thinking itself), a `message` item with the
answer's `output_text`, a `function_call` item per call. Streamed, they come as the API's events, each
with its `sequence_number`: `response.created` and `.in_progress`, then per item `output_item.added`,
its content's `.added` / `.delta` / `.done` events and `output_item.done`, and `response.completed` (or
`response.incomplete` when `max_output_tokens` cut it); an `error` event if the engine cuts it off.
Nothing is kept: every response says `store: false`.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.service.http.errors import ApiError
from engine.service.http.generation import EventStream, Generation, collect, pieces, prepare, sse, start_all
from engine.service.http.reply import Piece, Reply, Tally, Whole
from engine.service.http.responses.schemas import NamedFunction, ResponsesRequest
from engine.service.http.state import ApiState

ENDPOINT = "responses"  # the metrics label

__all__ = ["respond"]


async def respond(state: ApiState, request: Request, body: ResponsesRequest) -> Response:
    """`POST /v1/responses`: the whole response, or its stream of events."""
    prepared = await prepare(state, body)
    generations = await start_all(state, request, ENDPOINT, prepared.requests, count_prompt=False)
    reply = Reply({gen.index: gen.prompt_tokens for gen in generations}, calls_in=prepared.calls_in,
                  one_call=prepared.one_call)
    dress = Dress(body, prepared.model, reply.usage)
    if body.stream:
        return EventStream(_events(generations, reply, dress), generations)
    await collect(request, generations, reply)
    [(_, whole)] = reply.finish()
    if whole.finish_reason == "abort":
        raise _aborted()
    return JSONResponse(dress.response(_items(whole, dress.summary), whole.finish_reason))


def _aborted() -> ApiError:
    return ApiError(503, "the request was aborted in the engine (it is shutting down, or an operator aborted it)",
                    "server_error", code="aborted")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Dress:
    """The response object around the output items: the request's settings given back, status, usage."""

    def __init__(self, body: ResponsesRequest, model: str, usage: Tally) -> None:
        self.body, self.model, self.usage = body, model, usage
        self.id, self.created = _id("resp"), int(time.time())
        self.summary = body.reasoning is not None and body.reasoning.summary is not None

    def response(self, output: list[dict[str, Any]], finish_reason: str | None) -> dict[str, Any]:
        """The response object; `finish_reason` None while it is in progress."""
        b = self.body
        status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": b.temperature, "top_p": b.top_p,
            "tool_choice": b.tool_choice.model_dump() if isinstance(b.tool_choice, NamedFunction)
            else b.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "text": {"format": b.text.format.model_dump(by_alias=True, exclude_none=True)
                     if b.text is not None and b.text.format is not None else {"type": "text"}},
            "reasoning": b.reasoning.model_dump() if b.reasoning is not None else {"effort": None, "summary": None},
            "store": False, "background": False, "previous_response_id": None, "truncation": "disabled",
            "metadata": b.metadata or {}, "usage": self.usage_body() if finish_reason is not None else None}

    def usage_body(self) -> dict[str, Any]:
        u = self.usage
        return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                "total_tokens": u.prompt_tokens + u.completion_tokens}


def _reasoning_item(id_: str, text: str, summary: bool, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": id_, "status": status,
            "summary": [{"type": "summary_text", "text": text}] if summary and status == "completed" else [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def _message_item(id_: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {"type": "message", "id": id_, "status": status, "role": "assistant", "content": content}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(id_: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": id_, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _items(whole: Whole, summary: bool) -> list[dict[str, Any]]:
    """A whole reply's output items: its thinking, its answer (unless it is only calls), its calls."""
    status = "incomplete" if whole.finish_reason == "length" else "completed"
    items = [_reasoning_item(_id("rs"), whole.reasoning, summary, "completed")] if whole.reasoning else []
    if whole.text or not whole.tool_calls:  # a reply with neither text nor calls still has its message
        items.append(_message_item(_id("msg"), whole.text or "", status))
    items += [_call_item(_id("fc"), c.id, c.name, c.arguments, "completed") for c in whole.tool_calls]
    return items


@dataclass
class _Open:
    """The output item being streamed: its kind, index, id and what it has gathered."""

    kind: str
    index: int
    id: str
    text: str = ""
    call: dict[str, Any] = field(default_factory=dict)


class _Stream:
    """The stream's events as pieces arrive, numbered: an item opens when its kind of output starts
    (thinking, text, a call) and is done when another begins or the reply ends."""

    def __init__(self, dress: Dress) -> None:
        self.dress = dress
        self.sequence = 0
        self.done: list[dict[str, Any]] = []  # the finished items, for the last response object
        self.open: _Open | None = None

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(payload, event=kind)

    def lifecycle(self, kind: str, finish_reason: str | None) -> str:
        return self.event(kind, response=self.dress.response(self.done, finish_reason))

    def piece(self, piece: Piece) -> Iterator[str]:
        if piece.reasoning:
            yield from self._to("reasoning")
            yield from self._reasoning_delta(piece.reasoning)
        if piece.text:
            yield from self._to("message")
            assert self.open is not None
            self.open.text += piece.text
            yield self.event("response.output_text.delta", item_id=self.open.id, output_index=self.open.index,
                             content_index=0, delta=piece.text, logprobs=[])
        for d in piece.tool_calls:
            if d.id is not None:
                yield from self._to("function_call", {"call_id": d.id, "name": d.name})
            if d.arguments:
                assert self.open is not None
                self.open.text += d.arguments
                yield self.event("response.function_call_arguments.delta", item_id=self.open.id,
                                 output_index=self.open.index, delta=d.arguments)

    def _reasoning_delta(self, text: str) -> Iterator[str]:
        item = self.open
        assert item is not None
        item.text += text
        yield self.event("response.reasoning_text.delta", item_id=item.id, output_index=item.index, content_index=0,
                         delta=text)
        if self.dress.summary:
            yield self.event("response.reasoning_summary_text.delta", item_id=item.id, output_index=item.index,
                             summary_index=0, delta=text)

    def _to(self, kind: str, call: dict[str, Any] | None = None) -> Iterator[str]:
        """Make an item of `kind` the open one (a call always opens its own)."""
        if self.open is not None and self.open.kind == kind and kind != "function_call":
            return
        yield from self.close("completed")
        item = self.open = _Open(kind, len(self.done), _id({"reasoning": "rs", "message": "msg"}.get(kind, "fc")),
                                 call=call or {})
        yield self.event("response.output_item.added", output_index=item.index, item=self._item(item, "in_progress"))
        if kind == "message":
            yield self.event("response.content_part.added", item_id=item.id, output_index=item.index,
                             content_index=0, part=_output_text(""))
        elif kind == "reasoning" and self.dress.summary:
            yield self.event("response.reasoning_summary_part.added", item_id=item.id, output_index=item.index,
                             summary_index=0, part={"type": "summary_text", "text": ""})

    def end(self, status: str) -> Iterator[str]:
        """The last item's closing events; a reply with neither text nor calls still has its message."""
        if not any(item["type"] != "reasoning" for item in self.done) and \
                (self.open is None or self.open.kind == "reasoning"):
            yield from self._to("message")
        yield from self.close(status)

    def close(self, status: str) -> Iterator[str]:
        """The open item's closing events."""
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "message":
            yield self.event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[])
            yield self.event("response.content_part.done", **where, content_index=0, part=_output_text(item.text))
        elif item.kind == "reasoning":
            yield self.event("response.reasoning_text.done", **where, content_index=0, text=item.text)
            if self.dress.summary:
                yield self.event("response.reasoning_summary_text.done", **where, summary_index=0, text=item.text)
                yield self.event("response.reasoning_summary_part.done", **where, summary_index=0,
                                 part={"type": "summary_text", "text": item.text})
        else:
            yield self.event("response.function_call_arguments.done", **where, arguments=item.text)
        done = self._item(item, status)
        self.done.append(done)
        yield self.event("response.output_item.done", output_index=item.index, item=done)

    def _item(self, item: _Open, status: str) -> dict[str, Any]:
        if item.kind == "reasoning":
            return _reasoning_item(item.id, item.text, self.dress.summary, status)
        if item.kind == "message":
            return _message_item(item.id, item.text if status != "in_progress" else None, status)
        return _call_item(item.id, item.call["call_id"], item.call["name"], item.text, status)


async def _events(generations: list[Generation], reply: Reply, dress: Dress) -> AsyncGenerator[str, None]:
    """The whole stream (see the module); an `error` event ends it if the engine cuts it off or aborts."""
    stream = _Stream(dress)
    yield stream.lifecycle("response.created", None)
    yield stream.lifecycle("response.in_progress", None)
    finish = None
    try:
        async with contextlib.aclosing(pieces(generations, reply)) as source:
            async for _, piece in source:
                for event in stream.piece(piece):
                    yield event
                finish = piece.finish_reason or finish
        if finish == "abort":
            raise _aborted()
    except ApiError as e:
        yield stream.event("error", code=e.code, message=e.message, param=e.param)
        return
    for event in stream.end("incomplete" if finish == "length" else "completed"):
        yield event
    yield stream.lifecycle("response.incomplete" if finish == "length" else "response.completed", finish)
