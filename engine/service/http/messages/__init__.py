"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as llama.cpp's server
and vLLM serve it: the body (schemas.py) becomes one engine request, run by the machinery the OpenAI
routes use (generation.py) and read by the same choice writer (reply.py: thinking, text, tool calls), and
its pieces are dressed as Anthropic's content blocks: a whole `message`, or the stream's events
(`message_start`, `content_block_start` / `_delta` / `_stop` per block, `message_delta` with the stop
reason and usage, `message_stop`; an `error` event if the engine cuts the stream off).

Thinking comes as a `thinking` block ahead of the text, with an empty signature (nothing is signed here).
Usage counts the prompt's tokens the prefix cache served as `cache_read_input_tokens`, apart from
`input_tokens`, as Anthropic counts cache reads; a stream's `message_start` cannot know them yet (they come
with the Final), so it says every prompt token is input and its `message_delta` corrects both.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.prompt import is_chat
from engine.service.http.errors import ApiError, anthropic_body
from engine.service.http.generation import EventStream, Generation, collect, pieces, prepare, sse, start_all
from engine.service.http.messages.schemas import MessagesInput, MessagesRequest
from engine.service.http.reply import Piece, Reply, Tally, Whole
from engine.service.http.state import ApiState, engine_call
from engine.tools import ToolCall

ENDPOINT = "messages"  # the metrics label
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

__all__ = ["count_tokens", "respond"]


async def respond(state: ApiState, request: Request, body: MessagesRequest) -> Response:
    """`POST /v1/messages`: the whole message, or its stream of events."""
    prepared = await prepare(state, body)
    generations = await start_all(state, request, ENDPOINT, prepared.requests, count_prompt=body.stream)
    reply = Reply({gen.index: gen.prompt_tokens for gen in generations}, calls_in=prepared.calls_in,
                  one_call=prepared.one_call)
    message = Message(f"msg_{uuid.uuid4().hex}", prepared.model, reply.usage, prepared.reasoning)
    if body.stream:
        return EventStream(_events(generations, reply, message), generations)
    await collect(request, generations, reply)
    [(_, whole)] = reply.finish()
    return JSONResponse(message.whole(whole))


async def count_tokens(state: ApiState, body: MessagesInput) -> dict[str, int]:
    """`POST /v1/messages/count_tokens`: the prompt's tokens, as a create of the same input would count them."""
    prepared = await prepare(state, body)
    req = prepared.requests[0]
    await state.require_engine()
    assert is_chat(req.prompt)
    ids = await engine_call(state.client.tokenize(req.prompt, tools=req.tools, template_kwargs=req.template_kwargs))
    return {"input_tokens": len(ids)}


def stop_reason(finish_reason: str | None, stop_string: str | None) -> str:
    """Anthropic's stop reason for the engine's finish reason; an aborted request is an error instead."""
    if finish_reason == "abort" or finish_reason is None:
        raise ApiError(503, "the request was aborted in the engine (it is shutting down, or an operator aborted "
                            "it)", "server_error", code="aborted")
    return "stop_sequence" if stop_string is not None else STOP_REASONS.get(finish_reason, "end_turn")


class Message:
    """One reply as Anthropic's `message`: whole, or the pieces of its stream, block by block."""

    def __init__(self, id_: str, model: str, usage: Tally, reasoning: bool) -> None:
        self.id, self.model, self.usage, self.reasoning = id_, model, usage, reasoning

    def envelope(self, content: list[dict[str, Any]], stop: str | None, stop_string: str | None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop, "stop_sequence": stop_string, "usage": self.usage_body()}

    def usage_body(self) -> dict[str, Any]:
        u = self.usage
        body: dict[str, Any] = {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens}
        if u.done:
            body["cache_read_input_tokens"] = u.cached_tokens
            if self.reasoning:
                body["output_tokens_details"] = {"thinking_tokens": u.reasoning_tokens}
        return body

    def whole(self, whole: Whole) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if whole.reasoning:
            content.append({"type": "thinking", "thinking": whole.reasoning, "signature": ""})
        if whole.text:
            content.append({"type": "text", "text": whole.text})
        content += [_tool_use(call) for call in whole.tool_calls]
        return self.envelope(content, stop_reason(whole.finish_reason, whole.stop_string), whole.stop_string)


def _tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as a tool_use block; arguments cut off (max_tokens) before they were JSON are no input."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": call.id, "name": call.name,
            "input": arguments if isinstance(arguments, dict) else {}}


class _Blocks:
    """The stream's content blocks as pieces arrive: a block opens when its kind of content starts
    (thinking, text, a tool call) and closes when another begins or the reply ends."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # the kind of the open block

    def to(self, kind: str, start: dict[str, Any]) -> list[str]:
        """Events that make a block of `kind` (started as `start`) the open one."""
        if self.open == kind and kind != "tool_use":
            return []
        events = self.close()
        self.open = kind
        events.append(_event("content_block_start", index=self.count, content_block=start))
        return events

    def delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self.count, delta=delta)

    def close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self.delta({"type": "signature_delta", "signature": ""}))
        events.append(_event("content_block_stop", index=self.count))
        self.open, self.count = None, self.count + 1
        return events


def _event(kind: str, **fields: Any) -> str:
    return sse({"type": kind, **fields}, event=kind)


def _piece_events(blocks: _Blocks, piece: Piece) -> list[str]:
    """The events one piece adds: thinking, text, then tool-call blocks (each call a block of its own)."""
    events = []
    if piece.reasoning:
        events += blocks.to("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        events.append(blocks.delta({"type": "thinking_delta", "thinking": piece.reasoning}))
    if piece.text:
        events += blocks.to("text", {"type": "text", "text": ""})
        events.append(blocks.delta({"type": "text_delta", "text": piece.text}))
    for d in piece.tool_calls:
        if d.id is not None:
            events += blocks.to("tool_use", {"type": "tool_use", "id": d.id, "name": d.name, "input": {}})
        if d.arguments:
            events.append(blocks.delta({"type": "input_json_delta", "partial_json": d.arguments}))
    return events


async def _events(generations: list[Generation], reply: Reply, message: Message) -> AsyncGenerator[str, None]:
    """The stream: message_start, each block's events, message_delta and message_stop; or, when the engine
    cuts it off (or aborts the request), an error event in Anthropic's shape, which its SDK raises."""
    yield _event("message_start", message=message.envelope([], None, None) | {"usage": {
        "input_tokens": message.usage.prompt_tokens, "output_tokens": 0}})
    blocks = _Blocks()
    try:
        async with contextlib.aclosing(pieces(generations, reply)) as stream:
            async for _, piece in stream:
                for event in _piece_events(blocks, piece):
                    yield event
                if piece.finish_reason is not None:
                    stop = stop_reason(piece.finish_reason, piece.stop_string)
                    for event in blocks.close():
                        yield event
                    yield _event("message_delta", delta={"stop_reason": stop, "stop_sequence": piece.stop_string},
                                 usage=message.usage_body())
    except ApiError as e:
        yield sse(anthropic_body(e.status, e.message), event="error")
        return
    yield _event("message_stop")
