"""What the official `openai` SDK and lm-eval send beyond the basics, end to end against `minichat serve
--http` (test_http_api.py's server): vLLM's /tokenize and /detokenize, prompt lists on /v1/completions,
`models.retrieve`, continuous usage in streams, cached prompt tokens, validation errors worded as
OpenAI words them, and the console's history trimmed by the engine's token count."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from engine.service.client import AsyncEngineClient, EngineClient, EngineError
from tests import test_http_api as http_api
from tests.test_http_api import CHAT, KEY, Server, assert_error
from tui.session import Session

server = http_api.server  # the same fixtures, one server for this module
engine = http_api.engine

TEXT = "Continuous batching lets new requests use a slot"


# -- /tokenize and /detokenize ------------------------------------------------------------------
def test_tokenize_detokenize_round_trip(server: Server, engine: EngineClient) -> None:
    tokenizer = AutoTokenizer.from_pretrained(server.checkpoint)
    body = server.post("/tokenize", {"model": "tiny", "prompt": TEXT}).json()
    assert body["tokens"] == tokenizer.encode(TEXT) == engine.tokenize(TEXT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == engine.info().max_seq_len
    assert server.post("/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": TEXT}
    assert engine.detokenize(body["tokens"]) == TEXT


def test_tokenize_counts_chat_as_generation_does(server: Server, engine: EngineClient) -> None:
    counted = server.post("/tokenize", {"messages": CHAT}).json()
    reply = server.sdk().chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    assert counted["count"] == reply.usage.prompt_tokens == len(engine.tokenize(CHAT))
    bare = server.post("/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["tokens"] == counted["tokens"][: bare["count"]] and bare["count"] < counted["count"]
    assert bare["tokens"] == engine.tokenize(CHAT, add_generation_prompt=False)


def test_async_client_tokenizes_concurrently(server: Server) -> None:
    async def both() -> tuple[list[list[int]], str]:
        async with AsyncEngineClient(server.address) as client:
            ids = await asyncio.gather(*(client.tokenize(f"{TEXT} {i}") for i in range(5)))
            return list(ids), await client.detokenize(ids[0])

    ids, text = asyncio.run(both())
    assert len({tuple(i) for i in ids}) == 5 and text == f"{TEXT} 0"


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/detokenize", {"tokens": [5, 10**6]}, None, "token ids must be in [0, 384)"),
    ("/detokenize", {"tokens": []}, "tokens", "'tokens' must contain at least one token"),
    ("/detokenize", {"tokens": [3, -1]}, "tokens[1]", "tokens[1]: must be >= 0, got -1"),
    ("/tokenize", {"prompt": ""}, "prompt", "'prompt' must not be empty"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, None, "give exactly one of 'prompt' (text) or 'messages'"),
    ("/tokenize", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content",
     "messages[0].content: must be a string or a list, got 3"),
])
def test_tokenize_errors(server: Server, path: str, body: dict[str, Any], param: str | None, words: str) -> None:
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_engine_clients_refuse_bad_tokens(engine: EngineClient) -> None:
    for ids, words in (([], "token_ids is empty"), ([384], "[0, 384)"), ([-5], "[0, 384)")):
        with pytest.raises(EngineError, match=words.replace("[", r"\[").replace(")", r"\)")) as e:
            engine.detokenize(ids)
        assert e.value.code == "invalid_request"
    with pytest.raises(EngineError, match="the prompt is empty"):
        engine.tokenize("")
    assert engine.ping().pid  # the engine serves on


def test_console_trims_its_history_by_the_engines_count(engine: EngineClient) -> None:
    """The console's Session.fit drops the fewest oldest turns that make the history fit, as the engine
    counts tokens (one tokenize call when it fits)."""
    session = Session("trim", chosen={"max_tokens": 16})
    for i in range(9):
        turn = session.start_turn(f"turn {i}: {TEXT}")
        turn.reply.text = f"reply {i}: to be or not to be, that is the question " * (i % 3 + 1)
    session.start_turn("the new message")
    calls: list[int] = []

    async def count(messages: list[dict[str, str]]) -> int:
        calls.append(1)
        return len(engine.tokenize(messages))

    def tokens(start: int) -> int:
        return len(engine.tokenize(session.messages("the new message", start)))

    context = 300
    room = context - 16
    assert asyncio.run(session.fit("the new message", 10_000, count)) == 0 and len(calls) == 1
    dropped = asyncio.run(session.fit("the new message", context, count))
    assert dropped == session.context_start > 1
    assert tokens(dropped) <= room < tokens(dropped - 1)
    assert len(calls) <= 1 + 2 + 2 * dropped.bit_length()


# -- models.retrieve --------------------------------------------------------------------------------
def test_models_retrieve(server: Server) -> None:
    model = server.sdk().models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "minichat")
    with pytest.raises(openai.NotFoundError) as e:
        server.sdk().models.retrieve("gpt-9")
    assert_error(e.value, 404, "model", "model_not_found")


# -- prompt lists -------------------------------------------------------------------------------------
PROMPT_LISTS = {
    "strings": ["To be, or not to be", "The quick brown fox", "Pages of sixteen tokens"],
    "token lists": [[5, 17, 99, 200, 3], [7, 8, 9], [300, 12, 40, 41]],
    "one string": "Continuous batching",
    "token ids": [5, 17, 99, 200, 3],
}


def engine_prompts(prompt: Any) -> list[Any]:
    return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shape", list(PROMPT_LISTS))
def test_completion_prompt_forms(server: Server, engine: EngineClient, shape: str, stream: bool) -> None:
    prompt = PROMPT_LISTS[shape]
    own = [engine.complete(p, max_tokens=6, temperature=0.0, ignore_eos=True) for p in engine_prompts(prompt)]
    resp = server.sdk().completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=stream,
                                          stream_options={"include_usage": True} if stream else None,
                                          extra_body={"ignore_eos": True})
    if stream:
        chunks = list(resp)
        texts: dict[int, str] = defaultdict(str)
        finishes: dict[int, list[str]] = defaultdict(list)
        for c in chunks:
            for choice in c.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason:
                    finishes[choice.index].append(choice.finish_reason)
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        usage = chunks[-1].usage
        assert dict(finishes) == {i: ["length"] for i in range(len(own))}
        got = [texts[i] for i in range(len(own))]
    else:
        assert [c.index for c in resp.choices] == list(range(len(own)))
        assert all(c.finish_reason == "length" for c in resp.choices)
        usage, got = resp.usage, [c.text for c in resp.choices]
    assert got == [o.text for o in own]
    assert usage.prompt_tokens == sum(o.usage.prompt_tokens for o in own)
    assert usage.completion_tokens == 6 * len(own) and usage.total_tokens == usage.prompt_tokens + 6 * len(own)


def test_prompt_lists_run_concurrently(server: Server, engine: EngineClient) -> None:
    """The prompts of one request share engine steps (lm-eval sends its batches this way). Counted, not watched: run
    one after another, three 300-token prompts take at least one step per decoded token; sharing steps takes about a
    third of that. The engine's own counters say which happened, however late the test reads them."""
    before = engine.wait_stats(lambda s: not s.running and not s.waiting, timeout=30).counters
    prompts = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35]]
    resp = server.sdk().completions.create(model="tiny", prompt=prompts, max_tokens=300, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in resp.choices] == ["length"] * 3
    after = engine.wait_stats(lambda s: s.counters.finished >= before.finished + 3 and not s.running,
                              timeout=30).counters
    steps, tokens = after.steps - before.steps, after.decode_tokens - before.decode_tokens
    assert tokens >= 3 * 299
    assert steps < 0.67 * tokens, f"{steps} steps for {tokens} decoded tokens: the prompts did not share steps"


def test_a_refused_prompt_in_a_list_refuses_the_request_and_aborts_the_rest(server: Server,
                                                                          engine: EngineClient) -> None:
    too_long = [7] * (engine.info().max_seq_len + 1)
    aborted = engine.stats().counters.aborted
    with pytest.raises(openai.BadRequestError) as e:
        server.sdk().completions.create(model="tiny", prompt=[[5, 6, 7], too_long], max_tokens=2000,
                                        extra_body={"ignore_eos": True})
    assert_error(e.value, 400, code="prompt_too_long")
    snap = engine.wait_stats(lambda s: s.counters.aborted > aborted and not s.running and not s.waiting, 15)
    assert snap.pages.held == 0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_every_prompt(server: Server, engine: EngineClient, stream: bool) -> None:
    aborted = engine.stats().counters.aborted
    body = {"model": "tiny", "prompt": [[5, 6, 7], [8, 9, 10]], "max_tokens": 10_000, "ignore_eos": True,
            "stream": stream}

    def both_running(snap: Any) -> bool:
        return sum(r.rid.startswith("http-") and r.generated > 0 for r in snap.running) == 2

    async def leave_mid_request() -> None:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
            request = asyncio.ensure_future(client.post(server.url + "/completions", json=body))
            await asyncio.to_thread(engine.wait_stats, both_running)
            request.cancel()  # drops the connection mid-response
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(leave_mid_request())
    snap = engine.wait_stats(lambda s: s.counters.aborted >= aborted + 2
                             and not any(r.rid.startswith("http-") for r in s.running), 15)
    assert snap.pages.held == 0


# -- usage ------------------------------------------------------------------------------------------------
def text_of(chunk: Any) -> str:
    return "".join((getattr(c, "text", None) or getattr(getattr(c, "delta", None), "content", None) or "")
                   for c in chunk.choices)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats(server: Server, engine: EngineClient, endpoint: str) -> None:
    """Every chunk carries the usage so far: each text chunk the tokens generated up to it, as the engine's
    own stream of the same greedy request counts them."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    args = {"model": "tiny", "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": options,
            "extra_body": {"ignore_eos": True}}
    prompt: Any = "To be" if endpoint == "completions" else [{"role": "user", "content": "To be"}]
    sdk = server.sdk()
    chunks = list(sdk.completions.create(prompt=prompt, **args) if endpoint == "completions"
                  else sdk.chat.completions.create(messages=prompt, **args))
    own, so_far = [], 0
    for out in engine.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True):
        so_far += len(out.token_ids)
        if out.text:
            own.append(so_far)
    assert own, "the greedy reply never had text"
    assert all(c.usage is not None for c in chunks)
    assert {c.usage.prompt_tokens for c in chunks} == {len(engine.tokenize(prompt))}
    assert [c.usage.completion_tokens for c in chunks if text_of(c)] == own
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_continuous_usage_sums_over_prompts(server: Server, engine: EngineClient) -> None:
    prompts = ["To be", "or not", "The quick"]
    chunks = list(server.sdk().completions.create(
        model="tiny", prompt=prompts, max_tokens=5, temperature=0, stream=True,
        stream_options={"continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert {c.usage.prompt_tokens for c in chunks} == {sum(len(engine.tokenize(p)) for p in prompts)}
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 15 and chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.choices for c in chunks)  # no usage-only chunk without include_usage


def test_cached_tokens_count_a_repeated_prefix(server: Server, engine: EngineClient) -> None:
    page = engine.info().config["page_size"]
    prompt = f"{uuid.uuid4().hex} " + "Pages of sixteen tokens hold the keys and values " * 3
    first, second = (server.sdk().completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
                     for _ in range(2))
    n = first.usage.prompt_tokens
    assert n > 2 * page and first.usage.prompt_tokens_details.cached_tokens == 0
    # the whole prompt is cached but its last token, which must be computed for the logits: whole pages of that
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // page * page
    streamed = list(server.sdk().completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == (n - 1) // page * page


# -- validation errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"messages": []}, "messages", "'messages' must contain at least one message"),
    ({"temperature": -1}, "temperature", "temperature: must be >= 0, got -1"),
    ({"top_p": "high"}, "top_p", 'top_p: must be a number, got "high"'),
    ({"n": 65}, "n", "n: must be <= 64, got 65"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "top_logprobs: must be <= 20, got 21"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty: must be <= 2, got 2.5"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role",
     "messages[0].role: must be one of 'system', 'developer', 'user', 'assistant' or 'tool', got \"wizard\""),
    ({"messages": None}, "messages", "messages: must be a list, got null"),
    ({"stop": ["x", ""]}, "stop", "stop: stop strings must not be empty"),
])
def test_chat_validation_errors_are_sentences(server: Server, fields: dict[str, Any], param: str,
                                              message: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.sdk().chat.completions.create(**({"model": "tiny", "messages": CHAT, "max_tokens": 4} | fields))
    assert_error(e.value, 400, param, "invalid_value")
    assert e.value.response.json()["error"]["message"] == message


@pytest.mark.parametrize(("prompt", "param", "message"), [
    ([], "prompt", "'prompt' must contain at least one item"),
    ([1, -2], "prompt[1]", "prompt[1]: must be >= 0, got -2"),
    (["a", 1], "prompt[1]", "prompt[1]: must be a string, got 1"),
    ([[1, 2], []], "prompt[1]", "'prompt[1]' must contain at least one item"),
    (5, "prompt", "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                  "got 5"),
])
def test_completion_prompt_errors_are_sentences(server: Server, prompt: Any, param: str, message: str) -> None:
    r = server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"] | {"message": None} == {
        "message": None, "type": "invalid_request_error", "param": param, "code": "invalid_value"}
    assert r.json()["error"]["message"] == message


def test_missing_field_and_bad_json(server: Server) -> None:
    r = server.post("/v1/chat/completions", {"model": "tiny"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["message"] == "Missing required parameter: 'messages'."
    r = server.post("/v1/chat/completions", ["not", "an", "object"])
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert r.json()["error"]["message"].startswith("body: must be an object, got a list")
