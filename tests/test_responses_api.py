"""OpenAI's Responses API through `minichat serve --http` and the official `openai` SDK's `responses`, on a
tiny random Qwen3 with Qwen3's real template (tool calls in its `<tool_call>` format): plain, streamed (the
events add up to the whole response), json_schema through the grammar (the SDK's `parse`), a function
tool round trip, reasoning items, and what is not kept (store, previous_response_id) refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.checkpoints import with_context
from tests.real_templates import QWEN3, real_template
from tests.served import serve_http
from tests.test_reasoning import THINK, thinking_checkpoint

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"enum": ["Paris", "Rome"]}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast.", "parameters": WEATHER}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def sdk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("resp")
    path = with_context(thinking_checkpoint(root / "ckpt", real_template(QWEN3)), root / "long", 2048)
    for url, _ in serve_http(path, "--num-pages", "160"):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_plain(sdk):
    resp = sdk.responses.create(model="m", input="To be, or not to be", instructions="Be brief.",
                                max_output_tokens=12, **GREEDY)
    assert resp.object == "response" and resp.status == "incomplete" and resp.store is False
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in resp.output] == ["message"]
    assert resp.output_text and resp.usage.output_tokens == 12
    chat = sdk.chat.completions.create(model="m", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be, or not to be"}])
    assert resp.output_text == chat.choices[0].message.content  # the same prompt, the same greedy reply
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_add_up_to_the_whole_response(sdk):
    ask = [{"role": "user", "content": [{"type": "input_text", "text": "To be"}]}]
    whole = sdk.responses.create(model="m", input=ask, max_output_tokens=16, **GREEDY)
    events = list(sdk.responses.create(model="m", input=ask, max_output_tokens=16, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    last = events[-1].response
    assert last.output_text == whole.output_text and last.usage.output_tokens == whole.usage.output_tokens


def test_json_schema_through_the_grammar(sdk):
    class Weather(BaseModel):
        city: Literal["Paris", "Rome"]

    resp = sdk.responses.create(model="m", input="Weather?", max_output_tokens=300, reasoning={"effort": "none"},
                                text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}, **GREEDY)
    jsonschema.validate(json.loads(resp.output_text), WEATHER)
    with sdk.responses.stream(model="m", input="Weather?", max_output_tokens=300, **GREEDY, text_format=Weather,
                              reasoning={"effort": "none"}) as stream:
        parsed = stream.get_final_response()  # completed: the grammar ended the reply
    assert isinstance(parsed.output_parsed, Weather)


def test_a_function_tool_round_trip(sdk):
    named = {"type": "function", "name": "get_weather"}  # exactly one call ("required" may go on calling)
    resp = sdk.responses.create(model="m", input="Weather in Paris?", tools=TOOLS, max_output_tokens=200,
                                tool_choice=named, reasoning={"effort": "none"}, **GREEDY)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and resp.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    streamed = list(sdk.responses.create(model="m", input="Weather in Paris?", tools=TOOLS, max_output_tokens=200,
                                         tool_choice=named, reasoning={"effort": "none"}, stream=True, **GREEDY))
    done = [e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    follow = sdk.responses.create(model="m", tools=TOOLS, max_output_tokens=4, **GREEDY, input=[
        {"role": "user", "content": "Weather in Paris?"}, *[c.model_dump(exclude_none=True) for c in calls],
        *[{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny"} for c in calls]])
    assert follow.usage.input_tokens > resp.usage.input_tokens  # the calls and their results reached the prompt


def test_reasoning_items(sdk):
    """`<think>` first (logit_bias, a minichat extension here too), its budget spent by the engine's default
    of none: the model's free `<think>`s are the thinking, the summary asked for is that thinking."""
    body = {"logit_bias": {str(THINK): 100}}
    resp = sdk.responses.create(model="m", input="To be", max_output_tokens=6, reasoning={"summary": "auto"},
                                extra_body=body, **GREEDY)
    [item] = [i for i in resp.output if i.type == "reasoning"]
    assert item.content[0].text == "<think>" * 5 and item.summary[0].text == item.content[0].text
    assert resp.usage.output_tokens_details.reasoning_tokens == 6
    events = list(sdk.responses.create(model="m", input="To be", max_output_tokens=6, stream=True,
                                       reasoning={"summary": "auto"}, extra_body=body, **GREEDY))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "<think>" * 5
    assert "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta") == "<think>" * 5


@pytest.mark.parametrize(("items", "says"), [
    ([{"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}],
     "input[1].call_id: no function_call with call_id 'call_1' before it"),
    ([{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{not json"}],
     "input[1].arguments: not JSON")])
def test_calls_that_do_not_add_up_are_a_400(sdk, items, says):
    """A result of no call, or a call whose arguments are not JSON, would reach the template as nonsense."""
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model="m", max_output_tokens=4, input=[{"role": "user", "content": "Weather?"}, *items])
    assert says in e.value.body["message"], e.value.body


@pytest.mark.parametrize(("body", "param"), [({"store": True}, "store"), ({"previous_response_id": "resp_1"},
                                                                            "previous_response_id"),
                                             ({"include": ["reasoning.encrypted_content"]}, "include"),
                                             ({"tools": [{"type": "web_search"}]}, "tools[0].type")])
def test_what_is_not_kept_or_not_honoured_is_a_400(sdk, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model="m", input="To be", max_output_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body
