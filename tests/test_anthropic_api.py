"""Anthropic's Messages API through `minichat serve --http` and the official `anthropic` SDK, on tiny random
Qwen3 checkpoints: with Qwen3's real template (tool calls in its `<tool_call>` format) behind an API key,
and with llama.cpp's copy of DeepSeek-R1-Distill's template, whose prompt opens the think block when
thinking is enabled (so a random model thinks, and the budget closes it).

create and stream (the SDK's event accumulator gives the same message as the whole reply), thinking
blocks, a tool round trip, count_tokens against the engine's own count, and errors in Anthropic's shape
(which the SDK raises as its typed errors)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest

from engine.service.client import EngineClient
from tests.checkpoints import with_context
from tests.real_templates import DEEPSEEK_R1, QWEN3, real_template
from tests.served import serve_http
from tests.test_reasoning import thinking_checkpoint

KEY = "anthropic-test-key"
ASK = [{"role": "user", "content": "To be, or not to be"}]
GREEDY = {"temperature": 0}  # the SDK no longer has the parameter; the API still takes it
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"enum": ["Paris", "Rome"]}}}
TOOLS = [{"name": "get_weather", "description": "Weather forecast.", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    root = tmp_path_factory.mktemp("aq")
    path = with_context(thinking_checkpoint(root / "ckpt", real_template(QWEN3)), root / "long", 2048)  # tools
    yield from serve_http(path, "--num-pages", "160", "--api-key", KEY)


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    yield from serve_http(thinking_checkpoint(tmp_path_factory.mktemp("ar"), real_template(DEEPSEEK_R1)),
                          "--num-pages", "160")


def client(server: tuple[str, str], key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server[0], api_key=key, max_retries=0, timeout=120)


def test_create_and_its_stream_agree(qwen):
    sdk = client(qwen)
    whole = sdk.messages.create(model="m", max_tokens=16, messages=ASK, system="Be brief.", extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "m"
    assert [b.type for b in whole.content] == ["text"] and whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 16
    with sdk.messages.stream(model="m", max_tokens=16, messages=ASK, system="Be brief.", extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    # the same prompt again: its pages come from the prefix cache, which Anthropic's usage calls cache reads
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens > 0


def test_a_stop_sequence_is_named(qwen):
    sdk = client(qwen)
    whole = sdk.messages.create(model="m", max_tokens=16, messages=ASK, extra_body=GREEDY)
    text = whole.content[0].text
    stop = text[3:5]
    cut = sdk.messages.create(model="m", max_tokens=16, messages=ASK, stop_sequences=[stop], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_count_tokens_is_the_engines_count(qwen):
    sdk = client(qwen)
    counted = sdk.messages.count_tokens(model="m", messages=ASK, system="Be brief.", tools=TOOLS)
    with EngineClient(qwen[1]) as engine:
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast.",
                                                   "parameters": WEATHER}}]
        ids = engine.tokenize([{"role": "system", "content": "Be brief."}, *ASK], tools=tools)
    assert counted.input_tokens == len(ids)
    # and a create of the same input counts it so (the prompt's first pass: no cache reads yet)
    made = sdk.messages.create(model="m", max_tokens=1, messages=ASK, system="Be brief.", tools=TOOLS)
    assert made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0) == counted.input_tokens


def test_a_tool_round_trip(qwen):
    sdk = client(qwen)
    off = {"type": "disabled"}  # forced calls: the model must not think first (Anthropic refuses them with thinking)
    first = sdk.messages.create(model="m", max_tokens=200, messages=ASK, tools=TOOLS, thinking=off,
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 1})
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    with sdk.messages.stream(model="m", max_tokens=200, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
                             thinking=off, extra_body=GREEDY) as s:
        streamed = s.get_final_message()
    whole = sdk.messages.create(model="m", max_tokens=200, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
                                thinking=off, extra_body=GREEDY)
    uses = [b for b in streamed.content if b.type == "tool_use"]
    assert uses and [(b.name, b.input) for b in uses] == [(b.name, b.input) for b in whole.content
                                                           if b.type == "tool_use"]
    for b in uses:  # "any": one call or more, each following the tool's schema
        jsonschema.validate(b.input, WEATHER)
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24C"},
                                            {"type": "text", "text": "And tomorrow?"}]}]
    second = sdk.messages.create(model="m", max_tokens=8, messages=history, tools=TOOLS, extra_body=GREEDY)
    assert second.usage.output_tokens > 0 and second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # the result reached the prompt: the conversation counts more tokens than the question alone
    assert sdk.messages.count_tokens(model="m", messages=history, tools=TOOLS).input_tokens > \
        sdk.messages.count_tokens(model="m", messages=ASK, tools=TOOLS).input_tokens + 20


def test_thinking_blocks_come_from_the_think_block(r1):
    sdk = client(r1)
    thinking = {"type": "enabled", "budget_tokens": 5}
    whole = sdk.messages.create(model="m", max_tokens=12, messages=ASK, thinking=thinking, extra_body=GREEDY)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking and whole.content[0].signature == ""
    assert whole.usage.output_tokens_details.thinking_tokens == 6  # 5, and the end marker the budget wrote
    with sdk.messages.stream(model="m", max_tokens=12, messages=ASK, thinking=thinking, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content]
    off = sdk.messages.create(model="m", max_tokens=6, messages=ASK, thinking={"type": "disabled"},
                              extra_body=GREEDY)
    assert [b.type for b in off.content] == ["text"] and off.usage.output_tokens_details.thinking_tokens == 0


def test_errors_have_anthropics_shape(qwen, r1):
    sdk = client(qwen)
    with pytest.raises(anthropic.BadRequestError) as e:
        sdk.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].type" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        sdk.messages.create(model="m", max_tokens=4, messages=[*ASK, {"role": "assistant", "content": "Well"}])
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        sdk.messages.create(model="m", max_tokens=4, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
                            thinking={"type": "enabled", "budget_tokens": 8})
    with pytest.raises(anthropic.BadRequestError, match="output_config"):
        sdk.messages.create(model="m", max_tokens=4, messages=ASK, output_config={"effort": "high"})
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.create(model="another", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(qwen, key="wrong").messages.create(model="m", max_tokens=4, messages=ASK)
    assert auth.value.body["error"]["type"] == "authentication_error"
    # a body over the limit is refused before it is read, in Anthropic's shape too
    big = httpx.post(qwen[0] + "/v1/messages", headers={"x-api-key": KEY}, content=b"x" * (3 << 20))
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.BadRequestError, match="no tool calling"):
        client(r1).messages.create(model="m", max_tokens=4, messages=ASK, tools=TOOLS)
    # a number as a string, a tool result answering no call, a body that is not JSON: 400s that say so
    loose = httpx.post(qwen[0] + "/v1/messages", headers={"x-api-key": KEY},
                       json={"model": "m", "max_tokens": "10", "messages": ASK})
    assert loose.status_code == 400 and "max_tokens: must be an integer" in loose.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\]\.tool_use_id: no tool_use"):
        sdk.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}])
    garbage = httpx.post(qwen[0] + "/v1/messages", headers={"x-api-key": KEY, "content-type": "application/json"},
                         content=b"garbage")
    assert garbage.status_code == 400 and "b'" not in garbage.json()["error"]["message"], garbage.text


def test_json_output_format_through_the_grammar(qwen):
    sdk = client(qwen)
    resp = sdk.messages.create(model="m", max_tokens=300, messages=ASK, extra_body=GREEDY,
                               thinking={"type": "enabled", "budget_tokens": 3},
                               output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    [text] = [b.text for b in resp.content if b.type == "text"]  # after the thinking, if the model thought
    jsonschema.validate(json.loads(text), WEATHER)
