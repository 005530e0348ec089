"""Tool calls through `minichat serve --http` and the official `openai` SDK, on a random tiny Qwen2
whose chat template has Qwen's `<tool_call>` format: "required" and a named function are enforced by
the grammar (every sample parses into calls whose arguments follow the tool's schema), streamed and
not; a conversation carrying calls and their results renders; a model without tool calling refuses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.checkpoints import QWEN_TOOLS_TEMPLATE, make_checkpoint, make_tools_tokenizer, with_context
from tests.served import serve_http

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def serve(model: Path) -> Iterator[openai.OpenAI]:
    for root, _ in serve_http(model):
        yield openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def sdk(tmp_path_factory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("tools")
    path = with_context(make_checkpoint("qwen2", root / "qwen2"), root / "long", 4096)  # tools take ~750 tokens
    make_tools_tokenizer(path, QWEN_TOOLS_TEMPLATE)
    yield from serve(path)


def check_call(call, name: str | None = None) -> None:
    assert call.type == "function" and call.id
    assert call.function.name in {t["function"]["name"] for t in TOOLS} and (name is None or call.function.name == name)
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER)


def test_required_tool_calls_parse_and_follow_the_schema(sdk):
    resp = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", n=5,
                                       temperature=1.0, seed=1, max_tokens=400)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            check_call(call)


def test_parallel_calls_switched_off_make_one_call(sdk):
    """parallel_tool_calls false under "required": the grammar takes one call, then the end."""
    resp = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", n=5,
                                       parallel_tool_calls=False, temperature=1.0, seed=1, max_tokens=400)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        check_call(choice.message.tool_calls[0])


def test_a_named_function_streamed_is_one_call_of_it(sdk):
    for seed in range(3):
        calls: dict[int, dict] = {}
        finish = None
        for chunk in sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, seed=seed, temperature=1.0,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                 max_tokens=400, stream=True):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for piece in choice.delta.tool_calls or ():
                    call = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "args": ""})
                    call["args"] += piece.function.arguments or ""
        assert finish == "tool_calls" and len(calls) == 1
        assert calls[0]["name"] == "get_weather" and calls[0]["id"]
        jsonschema.validate(json.loads(calls[0]["args"]), WEATHER)


def test_auto_and_a_conversation_with_results(sdk):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    resp = sdk.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or ():
        assert call.function.name
    assert resp.usage.prompt_tokens > 20  # the tools and the call's result reached the template
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_model_without_tool_calling_refuses_tools(tmp_path):
    for client in serve(make_checkpoint("llama", tmp_path / "plain")):
        with pytest.raises(openai.BadRequestError, match="tool calling"):
            client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=4)
        assert client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none",
                                              max_tokens=2).choices[0].message.content is not None
