"""Tool calls (engine/tools.py): the format read off the chat template, tools rendered into the prompt,
model text parsed into calls whole and streamed (tags split anywhere), and the grammar that forces
calls producing calls whose arguments match the tools' schemas."""

from __future__ import annotations

import json
import random

import pytest

from engine.structured import GrammarCompiler
from engine.tokenizer import apply_chat_template, load_tokenizer
from engine.tools import (
    InvalidTools,
    ToolCall,
    ToolCallDelta,
    ToolCallStreamParser,
    forced_tool_grammar,
    parse_tool_calls,
    template_messages,
    tool_format,
)
from tests.checkpoints import LLAMA3_TOOLS_TEMPLATE, QWEN_TOOLS_TEMPLATE, VOCAB, make_tokenizer, make_tools_tokenizer
from tests.test_structured import DEMO, sample_through_grammar

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: its arguments must be {}
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD,
           "ping": {"type": "object", "properties": {}, "additionalProperties": False}}


def ids():
    """Predictable call ids, so whole and streamed parses can be compared."""
    counter = iter(range(1000))
    return lambda: f"call_{next(counter)}"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("tools")
    make_tokenizer(root / "plain")
    return {"qwen": load_tokenizer(make_tools_tokenizer(root / "qwen", QWEN_TOOLS_TEMPLATE)),
            "llama3": load_tokenizer(make_tools_tokenizer(root / "llama3", LLAMA3_TOOLS_TEMPLATE)),
            "plain": load_tokenizer(root / "plain")}


# ---------------------------------------------------------------- format and rendering


def test_format_is_read_off_the_chat_template(tokenizers) -> None:
    assert tool_format(tokenizers["qwen"]) == "qwen"
    assert tool_format(tokenizers["llama3"]) == "llama3"
    assert tool_format(tokenizers["plain"]) is None
    assert tool_format(load_tokenizer(DEMO)) is None
    assert tool_format(None) is None

    class Named:  # named templates: transformers renders "tool_use" when tools are given
        chat_template = {"default": "{{ messages }}", "tool_use": QWEN_TOOLS_TEMPLATE}
    assert tool_format(Named()) == "qwen"


@pytest.mark.parametrize("fmt", ["qwen", "llama3"])
def test_tools_and_past_calls_reach_the_prompt(tokenizers, fmt) -> None:
    tok = tokenizers[fmt]
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    prompt = tok.decode(apply_chat_template(tok, template_messages(conversation), tools=TOOLS))
    assert json.dumps(TOOLS[0]) in prompt  # the tool's definition, as JSON
    key = "arguments" if fmt == "qwen" else "parameters"
    assert f'{{"name": "get_weather", "{key}": {{"city": "Paris"}}}}' in prompt  # arguments not quoted twice
    assert "18 C" in prompt
    without = tok.decode(apply_chat_template(tok, conversation[:1]))
    assert "get_weather" not in without


def test_template_messages_leaves_the_input_alone() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}}
    original = [{"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "assistant", "content": "hi",
                 "tool_calls": [{"function": {"name": "g", "arguments": "{oops"}}]}]
    out = template_messages(original)
    assert out[0] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": [1]}}}]}
    assert out[1]["tool_calls"][0]["function"]["arguments"] == "{oops"  # not JSON: passed on as written
    assert original[0]["content"] is None and call["function"]["arguments"] == '{"x": [1]}'


# ---------------------------------------------------------------- parsing

QWEN_CASES = [
    # (model text, content, [(name, arguments)])
    ("The weather is fine.", "The weather is fine.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln, \\"DE\\" {}"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}"}]}}\n</tool_call>\n',
     "Let me check both.", [("get_weather", {"city": 'Köln, "DE" {}'}), ("add", {"a": 1, "b": [2, {"c": "}"}]})]),
    # keys in another order, and no arguments at all: parsed whole at the closing tag
    ('<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call> and <tool_call>{"name": "ping"}</tool_call>',
     "and", [("add", {"a": 1}), ("ping", {})]),
    # the closing tag never came (EOS right after the JSON)
    ('<tool_call>\n{"name": "ping", "arguments": {}}', None, [("ping", {})]),
    # not calls: given back as they were written
    ("a < b, and <tool_call> is how I call tools", "a < b, and <tool_call> is how I call tools", []),
    ("x <tool_call>\nnot json\n</tool_call> y", "x <tool_call>\nnot json\n</tool_call> y", []),
    ("ends with <tool_ca", "ends with <tool_ca", []),
]
LLAMA_CASES = [
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "ping", "parameters": {}}', None,
     [("add", {"a": 1, "b": 2}), ("ping", {})]),
    ('  {"parameters": {"city": "Oslo"}, "name": "get_weather"}', None, [("get_weather", {"city": "Oslo"})]),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
    ('Sure: {"name": "ping", "parameters": {}}', 'Sure: {"name": "ping", "parameters": {}}', []),
]
CASES = [("qwen", *c) for c in QWEN_CASES] + [("llama3", *c) for c in LLAMA_CASES]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_parse_whole_reply(fmt, text, content, calls) -> None:
    got_content, got_calls = parse_tool_calls(text, fmt, ids())
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_streamed_reply_equals_whole_reply_however_it_is_split(fmt, text, content, calls) -> None:
    whole = parse_tool_calls(text, fmt, ids())
    rng = random.Random(0)
    splits = [list(text)] + [_random_split(text, rng) for _ in range(30)]
    for pieces in splits:
        parser = ToolCallStreamParser(fmt, ids())
        deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        streamed_content = "".join(d.content for d in deltas)
        assert (streamed_content or None if whole[1] else streamed_content) == whole[0], pieces
        assert _assemble([c for d in deltas for c in d.tool_calls]) == whole[1], pieces
        if fmt == "qwen" and content == "Let me check both.":  # no piece of a tag ever shows as content
            assert all("<" not in d.content for d in deltas), pieces


def test_stream_delta_shapes() -> None:
    parser = ToolCallStreamParser("qwen", ids())
    pieces = ["Hi <tool", '_call>\n{"name": "get_weather", ', '"arguments": {"ci', 'ty": "Paris"}}\n</tool', "_call>"]
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    assert [d.content for d in deltas] == ["Hi", "", "", "", "", ""]
    first, *rest = [c.to_openai() for d in deltas for c in d.tool_calls]
    assert first == {"index": 0, "id": "call_0", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}
    assert all(set(r) == {"index", "function"} and set(r["function"]) == {"arguments"} for r in rest)
    assert "".join(r["function"]["arguments"] for r in rest) == '{"city": "Paris"}'
    assert len(rest) == 2, "the arguments stream as they arrive, not at the end"


def test_a_call_cut_short_keeps_what_it_streamed() -> None:
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "qwen", ids())
    assert content is None and calls == [ToolCall("call_0", "get_weather", '{"city": "Par')]


def _random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _assemble(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    calls: list[list[str]] = []
    for d in deltas:
        if d.id is not None:
            assert d.index == len(calls) and d.arguments == "" and d.name
            calls.append([d.id, d.name, ""])
        calls[d.index][2] += d.arguments
    return [ToolCall(*c) for c in calls]


# ---------------------------------------------------------------- forcing calls


@pytest.mark.parametrize("fmt", ["qwen", "llama3"])
@pytest.mark.parametrize("name", [None, "add"])
def test_forced_calls_parse_and_validate(tokenizers, fmt, name) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    tok = tokenizers[fmt]
    compiler = GrammarCompiler(tok, vocab_size=VOCAB, stop_token_ids=[tok.eos_token_id])
    texts = sample_through_grammar(compiler, tok, forced_tool_grammar(fmt, TOOLS, name), rows=12, seed=5)
    names = set()
    for text in texts:
        content, calls = parse_tool_calls(text, fmt)
        assert content is None and calls, text
        if name is not None or fmt == "llama3":
            assert len(calls) == 1, text
        for call in calls:
            assert call.name == name if name else call.name in SCHEMAS
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            names.add(call.name)
    if name is None:
        assert len(names) > 1, "any of the tools may be called"


@pytest.mark.parametrize(("tools", "name", "says"), [
    (TOOLS, "nope", "not among the tools"),
    ([], None, "no tools"),
    ([{"type": "function", "function": {"name": ""}}], None, "name must be a non-empty string"),
    ([{"type": "retrieval"}], None, r"tools\[0\] must be"),
    ([TOOLS[0], TOOLS[0]], None, "used twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "JSON schema object"),
])
def test_forced_grammar_refuses_bad_tools(tools, name, says) -> None:
    with pytest.raises(InvalidTools, match=says):
        forced_tool_grammar("qwen", tools, name)


def test_forced_grammar_kinds() -> None:
    assert forced_tool_grammar("llama3", TOOLS, "add").kind == "json_schema"
    spec = forced_tool_grammar("qwen", TOOLS)
    assert spec.kind == "structural_tag" and json.loads(str(spec.value))["format"]["at_least_one"] is True
    assert json.loads(str(forced_tool_grammar("qwen", TOOLS, "ping").value))["format"]["type"] == "tag"


def test_required_takes_several_calls_and_named_only_one(tokenizers) -> None:
    pytest.importorskip("xgrammar")
    tok = tokenizers["qwen"]
    compiler = GrammarCompiler(tok, vocab_size=VOCAB, stop_token_ids=[tok.eos_token_id])
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'

    def accepts(name: str | None, text: str, single: bool = False) -> bool:
        matcher = compiler.matcher(compiler.compile(forced_tool_grammar("qwen", TOOLS, name, one=single)))
        return all(matcher.accept(t) for t in [*tok.encode(text), tok.eos_token_id]) and matcher.is_terminated

    assert accepts(None, one) and accepts(None, two) and accepts("add", one)
    assert not accepts("add", two) and not accepts("ping", one) and not accepts(None, "Sure. " + one)
    assert accepts(None, one, single=True) and not accepts(None, two, single=True)  # parallel calls switched off
    assert not accepts(None, one.replace('"b": 2.5', '"b": "x"'))  # arguments must match the schema


@pytest.mark.parametrize("fmt", ["qwen", "llama3"])
def test_one_call_keeps_the_first_call_whole_and_streamed(fmt) -> None:
    """Parallel calls switched off (`parallel_tool_calls: false`) where no grammar forces one call: a reply the
    model wrote with two calls gives the client the first only, in the whole reply and in its stream, finishing
    as a call; the content around them is kept."""
    from engine.outputs import Delta, Final, Timings, Usage
    from engine.service.http.reply import Reply

    text, calls = next((t, k) for f, t, _, k in CASES if f == fmt and len(k) == 2)
    cut = len(text) // 3
    outputs = [Delta(rid="r", text=text[:cut], token_ids=[1]), Delta(rid="r", text=text[cut:], token_ids=[2]),
               Final(rid="r", text="", token_ids=[], finish_reason="stop",
                     usage=Usage(prompt_tokens=1, completion_tokens=2, cached_tokens=0),
                     timings=Timings(queue=0.0, ttft=0.1, total=0.2))]
    for one_call, want in ((False, calls), (True, calls[:1])):
        reply = Reply({0: 1}, calls_in=fmt, one_call=one_call)
        streamed = [c for out in outputs for piece in reply.feed(0, out)[1] for c in piece.tool_calls]
        ((_, whole),) = reply.finish()
        assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == want
        assert whole.finish_reason == "tool_calls" and {d.index for d in streamed} == set(range(len(want)))
