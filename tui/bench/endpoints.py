"""The streaming APIs the openai backend of `minichat bench` can drive, each as the body it sends and how
it reads the events back: `/v1/completions` (the default, and what other servers and gateways all serve),
`/v1/chat/completions`, Anthropic's `/v1/messages` and OpenAI's `/v1/responses`. The last three send the
prompt's text as one user message, so the chat template adds its tokens to the prompt; the token counts
are the server's usage in every case."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Event:
    """What one streamed event says: whether it carried output text, that the reply ended whole, the usage
    it reports (prompt, output and cached prompt tokens, each None where it says nothing), an error."""

    text: bool = False
    finished: bool = False
    aborted: bool = False
    prompt: int | None = None
    output: int | None = None
    cached: int | None = None
    error: str | None = None


class Endpoint:
    path = ""

    def body(self, model: str, prompt: str | list[int], max_tokens: int, temperature: float, ignore_eos: bool,
             seed: int | None, json_schema: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def read(self, event: dict[str, Any]) -> Event:
        raise NotImplementedError


def _error(event: dict[str, Any]) -> str | None:
    """An OpenAI-shaped error event's message (a stream the server could not finish)."""
    error = event.get("error")
    return f"stream cut off: {error.get('message')}" if isinstance(error, dict) else None


class Completions(Endpoint):
    path = "completions"
    field = "text"  # where a choice's text is

    def body(self, model: str, prompt: str | list[int], max_tokens: int, temperature: float, ignore_eos: bool,
             seed: int | None, json_schema: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
                                "ignore_eos": ignore_eos}
        if json_schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "bench", "schema": json.loads(json_schema)}}
        if seed is not None:
            body["seed"] = seed
        return body

    def read(self, event: dict[str, Any]) -> Event:
        choices = event.get("choices") or ()
        out = Event(text=any(self._text(c) for c in choices), finished=any(c.get("finish_reason") for c in choices),
                    aborted=any(c.get("finish_reason") == "abort" for c in choices), error=_error(event))  # vLLM's too
        if usage := event.get("usage"):
            out.prompt, out.output = usage["prompt_tokens"], usage["completion_tokens"]
            out.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return out

    def _text(self, choice: dict[str, Any]) -> bool:
        return bool(choice.get("text"))


class Chat(Completions):
    path = "chat/completions"

    def body(self, model: str, prompt: str | list[int], max_tokens: int, temperature: float, ignore_eos: bool,
             seed: int | None, json_schema: str | None) -> dict[str, Any]:
        body = super().body(model, prompt, max_tokens, temperature, ignore_eos, seed, json_schema)
        del body["prompt"]
        return body | {"messages": [{"role": "user", "content": _text(prompt)}]}

    def _text(self, choice: dict[str, Any]) -> bool:
        delta = choice.get("delta") or {}
        return bool(delta.get("content") or delta.get("reasoning_content"))


class Messages(Endpoint):
    """Anthropic's: text and thinking deltas, the prompt's count at message_start, the rest at message_delta."""

    path = "messages"

    def body(self, model: str, prompt: str | list[int], max_tokens: int, temperature: float, ignore_eos: bool,
             seed: int | None, json_schema: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": _text(prompt)}],
                                "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                                "ignore_eos": ignore_eos}
        if json_schema is not None:
            body["output_config"] = {"format": {"type": "json_schema", "schema": json.loads(json_schema)}}
        return body

    def read(self, event: dict[str, Any]) -> Event:
        kind = event.get("type")
        if kind == "error":
            return Event(error=f"stream cut off: {(event.get('error') or {}).get('message')}")
        if kind == "message_start":
            return Event(prompt=((event.get("message") or {}).get("usage") or {}).get("input_tokens"))
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            return Event(text=bool(delta.get("text") or delta.get("thinking") or delta.get("partial_json")))
        if kind == "message_delta":
            usage = event.get("usage") or {}
            cached = usage.get("cache_read_input_tokens")
            prompt = None if usage.get("input_tokens") is None else usage["input_tokens"] + (cached or 0)
            return Event(finished=True, prompt=prompt, output=usage.get("output_tokens"), cached=cached)
        return Event()


class Responses(Endpoint):
    """OpenAI's Responses API: output and reasoning text deltas, the usage in the last response object."""

    path = "responses"

    def body(self, model: str, prompt: str | list[int], max_tokens: int, temperature: float, ignore_eos: bool,
             seed: int | None, json_schema: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "input": _text(prompt), "max_output_tokens": max_tokens,
                                "temperature": temperature, "stream": True, "ignore_eos": ignore_eos}
        if json_schema is not None:
            body["text"] = {"format": {"type": "json_schema", "name": "bench", "schema": json.loads(json_schema)}}
        return body

    def read(self, event: dict[str, Any]) -> Event:
        kind = str(event.get("type"))
        if kind == "error":
            return Event(error=f"stream cut off: {event.get('message')}")
        if kind in ("response.output_text.delta", "response.reasoning_text.delta",
                    "response.function_call_arguments.delta"):
            return Event(text=bool(event.get("delta")))
        if kind in ("response.completed", "response.incomplete"):
            usage = (event.get("response") or {}).get("usage") or {}
            return Event(finished=True, prompt=usage.get("input_tokens"), output=usage.get("output_tokens"),
                         cached=(usage.get("input_tokens_details") or {}).get("cached_tokens"))
        return Event()


def _text(prompt: str | list[int]) -> str:
    if not isinstance(prompt, str):
        raise ValueError("a chat endpoint takes the prompt as text; this tokenizer cannot spell the workload as text")
    return prompt


ENDPOINTS: dict[str, Endpoint] = {"completions": Completions(), "chat": Chat(), "messages": Messages(),
                                  "responses": Responses()}
