"""What real clients ask of the HTTP API, end to end on the demo model (`minichat serve --http`):
log-probabilities and echo, n choices, the sampling surface, structured output through the official
`openai` SDK (`beta.chat.completions.parse` with a pydantic model), and lm-eval's `local-completions`
running a loglikelihood and a generate_until task from local YAML and JSON files to the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import httpx
import jsonschema
import pydantic
import pytest

from engine import LLM, SamplingParams
from engine.service.client import probe
from tests.test_http_api import free_port, minichat, stop, wait_http

DEMO = Path(__file__).parent.parent / "engine" / "demo_model"
LM_EVAL_TASKS = Path(__file__).parent / "data" / "lm_eval"


@pytest.fixture(scope="module")
def api() -> Iterator[str]:
    """`minichat serve --http` on the demo model; yields the root URL."""
    address = f"ipc://{tempfile.mkdtemp(prefix='mco')}/engine.sock"
    port = free_port()
    process = subprocess.Popen(minichat("serve", "--http", f"127.0.0.1:{port}", "--address", address,
                                        "--model", str(DEMO), "--served-model-name", "demo"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http(process, root + "/health")
        yield root
    finally:
        stop(process)
    assert probe(address) is None


@pytest.fixture(scope="module")
def sdk(api):
    import openai

    return openai.OpenAI(base_url=api + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle() -> LLM:
    return LLM(str(DEMO))


def test_completion_echo_logprobs_equal_the_engines_and_score_with_zero_tokens(api, sdk, oracle):
    prompt = "To be, or not to be, that is the question"
    ids = oracle.encode_prompt(prompt)
    own = oracle.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0].prompt_logprobs
    resp = sdk.completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = resp.choices[0]
    assert choice.text == prompt and resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in own[1:]], abs=1e-5)
    assert lp.tokens == [e.text for e in own] and "".join(lp.tokens) == prompt
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    # token-id prompts (lm-eval's form) echo their text; generated tokens follow with their own numbers
    more = sdk.completions.create(model="demo", prompt=ids, max_tokens=4, echo=True, logprobs=1, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert more.choices[0].text.startswith(prompt) and len(more.choices[0].logprobs.tokens) == len(ids) + 4


def test_chat_logprobs_streamed_and_not(sdk):
    chat = [{"role": "user", "content": "Good morrow"}]
    whole = sdk.chat.completions.create(model="demo", messages=chat, max_tokens=6, temperature=0, logprobs=True,
                                        top_logprobs=3, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == whole.choices[0].message.content
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy picks the top one
    stream = sdk.chat.completions.create(model="demo", messages=chat, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3, stream=True, extra_body={"ignore_eos": True})
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content])


def test_n_choices_with_a_seed_are_distinct_and_reproducible(sdk):
    chat = [{"role": "user", "content": "Speak, what say you?"}]
    kw = dict(model="demo", messages=chat, max_tokens=20, temperature=1.0, n=4, seed=11)
    first = sdk.chat.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1 and [c.message.content for c in sdk.chat.completions.create(**kw).choices] == texts
    streamed: dict[int, str] = {}
    for chunk in sdk.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(4)] == texts
    completions = sdk.completions.create(model="demo", prompt=["a", "b"], n=2, max_tokens=3, seed=1)
    assert [c.index for c in completions.choices] == [0, 1, 2, 3]


def test_the_sampling_surface_is_honoured_or_refused(api, sdk):
    prompt = "Good morrow, my lord"
    (word,) = httpx.post(api + "/tokenize", json={"prompt": " lord"}).json()["tokens"]
    forced = sdk.completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0,
                                    logit_bias={str(word): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " lord" * 4
    penalised = sdk.completions.create(model="demo", prompt=prompt, max_tokens=8, presence_penalty=1.5,
                                       frequency_penalty=1.0, extra_body={"min_p": 0.1, "repetition_penalty": 1.2,
                                                                          "min_tokens": 2, "seed": 3})
    assert penalised.usage.completion_tokens >= 2
    for body, param in [({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"999999": 1}}, None), ({"best_of": 3}, None),
                        ({"guided_regex": "a+", "guided_choice": ["x"]}, None)]:
        r = httpx.post(api + "/v1/completions", json={"model": "demo", "prompt": "x", **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param or param is None, r.json()


class Character(pydantic.BaseModel):
    name: Annotated[str, pydantic.StringConstraints(pattern=r"^[A-Za-z ]{1,12}$")]
    mood: Literal["merry", "sad", "wrathful"]
    age: Annotated[int, pydantic.Field(ge=0, le=120)]


def test_structured_output_through_the_sdk(api, sdk):
    parsed = sdk.beta.chat.completions.parse(model="demo", messages=[{"role": "user", "content": "Who art thou?"}],
                                             response_format=Character, max_tokens=200, temperature=0.8, seed=1)
    assert isinstance(parsed.choices[0].message.parsed, Character)
    schema = {"type": "object", "properties": {"lord": {"type": "boolean"}, "words": {"type": "array",
              "items": {"enum": ["ay", "nay"]}, "maxItems": 3}}, "required": ["lord", "words"]}
    for c in sdk.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Speak"}], n=3,
                                         max_tokens=400, temperature=1.0, seed=2, response_format={
                                             "type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
                                         ).choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    regex = sdk.completions.create(model="demo", prompt="x", max_tokens=20, extra_body={"guided_regex": r"[a-z]{3}!"})
    assert len(regex.choices[0].text) == 4 and regex.choices[0].text.endswith("!")
    nonsense = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nonsense"}}}
    bad = httpx.post(api + "/v1/chat/completions", json={
        "model": "demo", "messages": [{"role": "user", "content": "x"}], "response_format": nonsense})
    assert bad.status_code == 400 and "structured" in bad.json()["error"]["message"]


def test_lm_eval_local_completions_runs_both_task_kinds(api, tmp_path):
    """lm-eval (nobody here wrote it) against the server: token-list prompts, echo + logprobs for the
    loglikelihood task, greedy generation with a stop sequence for the other."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in ("minichat_choice.yaml", "minichat_generate.yaml"):
        text = (LM_EVAL_TASKS / name).read_text()
        text = text.replace("QUESTIONS_JSON", str(LM_EVAL_TASKS / "questions.json"))
        (tasks / name).write_text(text.replace("PROMPTS_JSON", str(LM_EVAL_TASKS / "prompts.json")))
    out = tmp_path / "results"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds"),
           "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         f"model=demo,base_url={api}/v1/completions,tokenizer_backend=huggingface,tokenizer={DEMO},"
         "num_concurrent=4,max_retries=1,tokenized_requests=True",
         "--tasks", "minichat_choice,minichat_generate", "--include_path", str(tasks), "--output_path", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= results["minichat_choice"]["acc,none"] <= 1.0
    assert 0.0 <= results["minichat_generate"]["exact_match,none"] <= 1.0
