"""Reasoning models: a tiny random Qwen3 with Qwen3's real chat template (and, for a prompt that opens the
think block itself, llama.cpp's copy of DeepSeek-R1-Distill's), its markers added tokens as in Qwen3's
tokenizer (tests/real_templates.py, tests/checkpoints.py).

In process: the markers are the template's own; a budget makes the engine write the template's close
after exactly that many thinking tokens, and the tokens around it are transformers' greedy ones (the
forced close is spliced in, nothing else changes), sequential and overlapped; a grammar starts after the
block. Over HTTP with the official openai SDK: think-then-answer forced with logit_bias (`<think>` +100
makes every free token a `<think>`; the budget closes the block), so `reasoning_content` and `content`
are known exactly, whole and streamed; thinking switched off by `chat_template_kwargs`; JSON that parses
after the thinking; what cannot be honoured refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from engine import LLM, SamplingParams
from engine.reasoning import think_markers
from engine.structured import GrammarSpec
from tests.checkpoints import THINKING_VOCAB, make_checkpoint, make_thinking_tokenizer
from tests.real_templates import DEEPSEEK_R1, QWEN3, real_template
from tests.served import serve_http

ASK = [{"role": "user", "content": "To be, or not to be"}]
THINK, END = 384, 385  # the markers' ids in the test tokenizer (after its 382 tokens and two specials)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer"],
          "properties": {"answer": {"enum": ["yes", "no"]}}}


def thinking_checkpoint(root: Path, template: str) -> Path:
    path = make_checkpoint("qwen3", root, vocab_size=THINKING_VOCAB)
    return make_thinking_tokenizer(path, template)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_checkpoint(tmp_path_factory.mktemp("qwen3"), real_template(QWEN3))


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_checkpoint(tmp_path_factory.mktemp("r1"), real_template(DEEPSEEK_R1))


def test_the_markers_are_the_templates_own(qwen3, r1):
    for path, lead in ((qwen3, "\n"), (r1, "")):
        llm = LLM(str(path), num_pages=64)
        markers = think_markers(llm.tokenizer)
        assert markers is not None and (markers.start, markers.end) == ("<think>", "</think>")
        assert (markers.start_id, markers.end_id) == (THINK, END)
        # the close is what the template writes before the end marker: Qwen3's "\n</think>", R1's "</think>"
        assert llm.tokenizer.decode(list(markers.close)) == lead + "</think>"
        llm.close()


@pytest.mark.parametrize(("overlap", "speculative"), [(False, None), (True, None), (False, "ngram"),
                                                     (True, "ngram")])
def test_the_budget_closes_the_block_and_the_rest_is_transformers_greedy(r1, hf, overlap, speculative):
    """R1's prompt opens the block (enable_thinking): 6 thinking tokens, the forced close, then the answer;
    each side of the close is transformers' greedy continuation of what came before, with or without
    overlap and speculative decoding (whose drafts wait until the close is written)."""
    llm = LLM(str(r1), num_pages=64, overlap=overlap, speculative=speculative, speculative_adaptive=False)
    prompt = llm.encode_prompt(ASK, template_kwargs={"enable_thinking": True})
    assert llm.tokenizer.decode(prompt).endswith("<think>\n")
    out = llm.generate([prompt], SamplingParams(max_tokens=24, reasoning=True, thinking_token_budget=6,
                                                ignore_eos=True))[0]
    markers = llm.think_markers
    assert markers is not None and list(markers.close) == [END]
    ids = out.token_ids
    hf.check_greedy(ids[:6], r1, prompt, 6)
    assert ids[6] == END
    hf.check_greedy(ids[7:], r1, prompt + ids[:7], 17)
    assert out.reasoning == llm.tokenizer.decode(ids[:6])
    # the answer's text, but for the bytes of a character max_tokens cut (the detokenizer never shows those)
    assert out.text == llm.tokenizer.decode(ids[7:]).rstrip("\ufffd")
    assert out.usage.reasoning_tokens == 7  # the thinking and its end marker (the start was the prompt's)
    if speculative is not None and not overlap:  # the answer's repeats are drafted (the random model loops)
        assert out.usage.draft_tokens > 0
    llm.close()


def test_without_a_budget_nothing_is_forced(r1, hf):
    llm = LLM(str(r1), num_pages=64)
    prompt = llm.encode_prompt(ASK, template_kwargs={"enable_thinking": True})
    out = llm.generate([prompt], SamplingParams(max_tokens=12, reasoning=True, ignore_eos=True))[0]
    hf.check_greedy(out.token_ids, r1, prompt, 12)
    assert out.text == "" and out.usage.reasoning_tokens == 12  # the block never closed: all of it is thinking
    llm.close()


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_the_grammar_starts_after_the_block(qwen3, speculative):
    """Every free token is `<think>` (logit_bias), so the thinking is `<think>` x budget, then the close, and
    the answer is JSON following the schema: the grammar masked `<think>` only after the block (with
    speculative decoding too: the `<think>`s repeat, so the ngram proposer drafts them)."""
    llm = LLM(str(qwen3), num_pages=64, speculative=speculative, speculative_adaptive=False)
    params = SamplingParams(max_tokens=80, reasoning=True, thinking_token_budget=3, logit_bias={THINK: 100.0},
                            structured=GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA)))
    out = llm.generate([ASK], params)[0]
    assert out.reasoning == "<think>" * 3 + "\n"
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.finish_reason == "stop" and out.usage.reasoning_tokens == 6  # <think>, 3 thinking, "\n", </think>
    llm.close()


@pytest.fixture(scope="module")
def sdk(qwen3) -> Iterator[openai.OpenAI]:
    for root, _ in serve_http(qwen3, "--num-pages", "64"):
        yield openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0, timeout=120)


FORCED = {"logit_bias": {str(THINK): 100}, "thinking_token_budget": 4}


def test_reasoning_content_and_content_split_exactly(sdk):
    resp = sdk.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0, extra_body=FORCED)
    message = resp.choices[0].message
    # <think>, 4 thinking tokens, "\n" and </think> (forced), then 5 tokens of answer
    assert message.reasoning_content == "<think>" * 4 + "\n"
    assert message.content == "<think>" * 5
    assert resp.usage.completion_tokens == 12 and resp.usage.completion_tokens_details.reasoning_tokens == 7
    assert resp.choices[0].finish_reason == "length"


def test_streamed_deltas_add_up_to_the_whole_reply(sdk):
    whole = sdk.chat.completions.create(model="m", messages=ASK, max_tokens=20, temperature=0, extra_body=FORCED)
    reasoning = content = ""
    usage = None
    for chunk in sdk.chat.completions.create(model="m", messages=ASK, max_tokens=20, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body=FORCED):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
        usage = chunk.usage or usage
    assert (reasoning, content) == (whole.choices[0].message.reasoning_content, whole.choices[0].message.content)
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == 7


def test_thinking_off_is_all_content(sdk):
    """enable_thinking false: Qwen3's template closes an empty block in the prompt, so the reply is the answer."""
    resp = sdk.chat.completions.create(model="m", messages=ASK, max_tokens=8, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = resp.choices[0].message
    assert message.reasoning_content is None and message.content
    assert resp.usage.completion_tokens_details.reasoning_tokens == 0


def test_json_schema_output_parses_after_the_thinking(sdk):
    resp = sdk.chat.completions.create(
        model="m", messages=ASK, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        extra_body={**FORCED, "thinking_token_budget": 2})
    message = resp.choices[0].message
    assert message.reasoning_content == "<think>" * 2 + "\n"
    jsonschema.validate(json.loads(message.content), SCHEMA)


@pytest.mark.parametrize(("body", "param"), [
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(sdk, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="m", messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_a_budget_for_a_model_that_does_not_think_is_refused(tmp_path, llama_ckpt):
    llm = LLM(str(llama_ckpt), num_pages=16)
    with pytest.raises(ValueError, match="thinking_token_budget: this model's chat template has no think block"):
        llm.add_request("To be", SamplingParams(max_tokens=4, reasoning=True, thinking_token_budget=2))
    llm.close()


def test_a_tool_call_follows_the_thinking(tmp_path):
    """tool_choice "required" (one call: parallel calls off) on a thinking model: the thinking stays
    `reasoning_content`, and the call's grammar starts after the block (closed by the budget), so what follows
    it is one call that parses and keeps the tool's schema, whole and streamed."""
    from tests.checkpoints import with_context
    from tests.test_tool_calls import TOOLS, check_call

    path = with_context(thinking_checkpoint(tmp_path / "qwen3", real_template(QWEN3)), tmp_path / "long", 4096)
    body = {**FORCED, "thinking_token_budget": 2}
    for root, _ in serve_http(path):
        client = openai.OpenAI(base_url=f"{root}/v1", api_key="none", max_retries=0, timeout=120)
        resp = client.chat.completions.create(model="m", messages=ASK, max_tokens=400, temperature=0, tools=TOOLS,
                                              tool_choice="required", parallel_tool_calls=False, extra_body=body)
        message = resp.choices[0].message
        assert message.reasoning_content == "<think>" * 2 + "\n" and not message.content
        assert len(message.tool_calls) == 1 and resp.choices[0].finish_reason == "tool_calls"
        check_call(message.tool_calls[0])
        reasoning, arguments = "", ""
        for chunk in client.chat.completions.create(model="m", messages=ASK, max_tokens=400, temperature=0,
                                                    tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                                    extra_body=body, stream=True):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                arguments += "".join(c.function.arguments or "" for c in choice.delta.tool_calls or ())
        assert reasoning == message.reasoning_content
        assert arguments == "".join(c.function.arguments for c in message.tool_calls)
