"""The OpenAI-compatible HTTP API end to end: `minichat serve --http` (a real engine child process and the
real front end on a free loopback port), driven with the official `openai` SDK and httpx, checked
against the engine's own client (EngineClient) and its stats."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from engine.pages import paint
from engine.service.client import EngineClient, probe
from engine.service.launcher import start
from kernels.cpu import load_cpu_kernels
from tui.bench.fleet import START_TIMEOUT, free_port, minichat, stop, wait_up

KEY = "test-key-123"


def wait_http(process: subprocess.Popen, url: str, headers: dict[str, str] | None = None) -> None:
    """Until `url` answers 200 (the front end is up and reaches its engine), or the process died."""
    wait_up(process, lambda: httpx.get(url, headers=headers, timeout=2.0).status_code == 200, url,
            lambda: process.stderr.read() if process.stderr else "")


@dataclass
class Server:
    url: str  # base URL with /v1
    root: str
    address: str  # the engine's
    model: str  # the served model id
    checkpoint: Path

    def sdk(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key or "none", max_retries=0, timeout=60)

    def get(self, path: str, key: str | None = KEY) -> httpx.Response:
        return httpx.get(self.root + path, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)

    def post(self, path: str, body: object, key: str | None = KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.root + path, json=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def server(long_ckpt: Path) -> Iterator[Server]:
    """`minichat serve --http` with an API key: the engine (16k context, so a request can stay running
    until aborted) in a child process and the front end in the foreground."""
    address = f"ipc://{tempfile.mkdtemp(prefix='mch')}/engine.sock"
    port = free_port()
    process = subprocess.Popen(minichat("serve", "--http", f"127.0.0.1:{port}", "--address", address,
                                        "--model", str(long_ckpt), "--api-key", KEY, "--served-model-name", "tiny"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http(process, root + "/health", {"Authorization": f"Bearer {KEY}"})
        yield Server(root + "/v1", root, address, "tiny", long_ckpt)
    finally:
        stop(process)
    assert process.returncode == 0, process.stderr.read() if process.stderr else ""
    assert probe(address) is None  # stopping the API stopped the engine it started


@pytest.fixture(scope="module")
def engine(server: Server) -> Iterator[EngineClient]:
    with EngineClient(server.address) as client:
        yield client


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be, or not to be"}]


def test_models_and_health(server, engine):
    models = server.sdk().models.list().data
    assert [m.id for m in models] == ["tiny"]
    # the weights' formats and their size in memory, as the engine reports them (float32 for this checkpoint)
    assert models[0].weights == engine.info().execution["weights"] and models[0].weights.startswith("float32, ")
    # which kernels run it: minichat's C kernels for this CPU's instruction set (tests/test_quant_kernels.py)
    assert models[0].cpu_kernels == f"on ({load_cpu_kernels().isa})"
    # what the model is: family and window (and experts, for a mixture of experts: tests/test_model_families.py)
    assert (models[0].family, models[0].architecture, models[0].window) == ("Llama", "LlamaForCausalLM", "none")
    assert server.get("/health").json()["status"] == "ok"


def test_chat_greedy_matches_the_engine_with_usage(server, engine):
    resp = server.sdk().chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True})
    own = engine.complete(CHAT, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert resp.choices[0].message.content == own.text and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == own.finish_reason == "length"
    template = AutoTokenizer.from_pretrained(server.checkpoint).apply_chat_template(CHAT, add_generation_prompt=True)
    n_template = len(template["input_ids"] if hasattr(template, "keys") else template)
    assert resp.usage.prompt_tokens == own.usage.prompt_tokens == n_template
    assert resp.usage.completion_tokens == len(own.token_ids) == 8
    assert resp.usage.total_tokens == n_template + 8


def test_chat_stream_with_usage(server, engine):
    stream = server.sdk().chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=8, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    chunks = list(stream)
    own = engine.complete(CHAT, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == own.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == own.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", ["Pages of sixteen tokens", [5, 17, 99, 200, 3]])
def test_completions_greedy_match_the_engine(server, engine, prompt, stream):
    resp = server.sdk().completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=stream,
                                          stream_options={"include_usage": True} if stream else None,
                                          extra_body={"ignore_eos": True})
    own = engine.complete(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
    if stream:
        chunks = list(resp)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        text, usage, finish = resp.choices[0].text, resp.usage, [resp.choices[0].finish_reason]
    assert text == own.text and finish == ["length"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (own.usage.prompt_tokens, 6)
    if isinstance(prompt, list):
        assert usage.prompt_tokens == len(prompt)


def test_stop_strings_end_the_output_before_them(server, engine):
    prompt = "The quick brown fox"
    full = engine.complete(prompt, max_tokens=24, temperature=0.0, ignore_eos=True).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"greedy output too short to pick a stop string from: {full!r}"
    expected = full[: full.index(stop)]
    for given in (stop, [stop, "never-appears"]):
        resp = server.sdk().completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                              stop=given, extra_body={"ignore_eos": True})
        assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    chat = server.sdk().chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0,
                                                stream=True, stop=[stop], extra_body={"ignore_eos": True})
    assert stop not in "".join(c.choices[0].delta.content or "" for c in chat if c.choices)


def assert_error(e: openai.APIStatusError, status: int, param: str | None = None, code: str | None = None) -> None:
    assert e.status_code == status
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in e.response.text
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 0}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None),
])
def test_invalid_fields_are_400(server, fields, param):
    args = {"model": "tiny", "messages": CHAT, "max_tokens": 4} | fields
    with pytest.raises(openai.BadRequestError) as e:
        server.sdk().chat.completions.create(**args)
    assert_error(e.value, 400, param)


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.sdk().completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert_error(e.value, 404, "model", "model_not_found")


def test_prompt_longer_than_the_context_is_400(server, engine):
    too_long = [7] * (engine.info().max_seq_len + 1)
    with pytest.raises(openai.BadRequestError) as e:
        server.sdk().completions.create(model="tiny", prompt=too_long, max_tokens=2, stream=True)
    assert_error(e.value, 400, code="prompt_too_long")
    assert "tokens" in e.value.response.json()["error"]["message"]


def test_malformed_json_and_unknown_route(server):
    r = httpx.post(server.url + "/chat/completions", content=b"{not json", timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = server.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"]


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_api_key_required(server, key):
    with pytest.raises(openai.AuthenticationError) as e:
        server.sdk(key).chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert_error(e.value, 401, code="invalid_api_key")
    assert server.get("/metrics", key).status_code == 401
    assert server.get("/health", key).status_code == 200  # a liveness probe needs no secret (issue 25)


def running_http_request(engine: EngineClient) -> str:
    """The rid of the HTTP request the engine is running (waits for it to be admitted)."""
    snap = engine.wait_stats(lambda s: any(r.rid.startswith("http-") and r.generated > 0 for r in s.running))
    return next(r.rid for r in snap.running if r.rid.startswith("http-"))


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_engine_request(server, engine, stream):
    aborted = engine.stats().counters.aborted
    body = {"model": "tiny", "prompt": "Continuous batching", "max_tokens": 10_000, "ignore_eos": True,
            "stream": stream}

    async def leave_mid_request() -> str:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            request = asyncio.ensure_future(http.post(server.url + "/completions", json=body))
            rid = await asyncio.to_thread(running_http_request, engine)
            request.cancel()  # drops the connection mid-response
            await asyncio.gather(request, return_exceptions=True)
            return rid

    rid = asyncio.run(leave_mid_request())
    snap = engine.wait_stats(lambda s: s.counters.aborted > aborted and all(r.rid != rid for r in s.running), 15)
    assert rid not in paint(snap.pages.total, snap.pages.runs, snap.pages.owners)[1] and snap.pages.held == 0


NEW_ENDPOINTS = {  # each new API's long request, and its metrics label
    "/messages": ({"model": "tiny", "messages": [{"role": "user", "content": "Continuous batching"}],
                   "max_tokens": 10_000, "ignore_eos": True}, "messages"),
    "/responses": ({"model": "tiny", "input": "Continuous batching", "max_output_tokens": 10_000,
                    "ignore_eos": True}, "responses"),
}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", sorted(NEW_ENDPOINTS))
def test_client_disconnect_aborts_the_new_apis_requests(server, engine, path, stream):
    """Anthropic's Messages and OpenAI's Responses: a client that leaves aborts its engine request too."""
    aborted = engine.stats().counters.aborted

    async def leave_mid_request() -> str:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            request = asyncio.ensure_future(http.post(server.url + path, json={**NEW_ENDPOINTS[path][0],
                                                                               "stream": stream}))
            rid = await asyncio.to_thread(running_http_request, engine)
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
            return rid

    rid = asyncio.run(leave_mid_request())
    snap = engine.wait_stats(lambda s: s.counters.aborted > aborted and all(r.rid != rid for r in s.running), 15)
    assert snap.pages.held == 0


@pytest.mark.parametrize("path", sorted(NEW_ENDPOINTS))
def test_the_new_apis_are_counted_in_the_metrics(server, path):
    label = NEW_ENDPOINTS[path][1]
    body = {**NEW_ENDPOINTS[path][0], "max_tokens" if path == "/messages" else "max_output_tokens": 3}
    before = metric_values(server)
    assert server.post("/v1" + path, body).status_code == 200
    assert server.post("/v1" + path, {**body, "model": "other"}).status_code == 404
    after = metric_values(server)
    for outcome, added in (("length", 1), ("404", 1)):
        name = f'minichat_http_requests_total{{"endpoint": "{label}", "outcome": "{outcome}"}}'
        assert after[name] == before.get(name, 0) + added, name
    assert after["minichat_generation_tokens_total"] - before["minichat_generation_tokens_total"] == 3


def metric_values(server: Server) -> dict[str, float]:
    text = server.get("/metrics").text
    return {f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_move_with_traffic(server):
    before = metric_values(server)
    for name in ("minichat_engine_up", "minichat_requests_waiting", "minichat_requests_running",
                 "minichat_request_slots_free", "minichat_kv_pages_free", "minichat_kv_pages_used",
                 "minichat_kv_pages_cached", "minichat_engine_requests_submitted_total",
                 "minichat_engine_requests_finished_total", "minichat_engine_requests_aborted_total",
                 "minichat_retractions_total"):
        assert name in before, name
    assert before["minichat_engine_up"] == 1
    assert before['minichat_kv_cache_dtype{"dtype": "float32"}'] == 1 and before["minichat_kv_page_bytes"] > 0
    resp = server.sdk().chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
    assert list(resp)[-1].choices[0].finish_reason == "length"
    end = time.monotonic() + 15
    while True:  # the engine's counters arrive with its next stats snapshot (~10 a second)
        after = metric_values(server)
        if after["minichat_engine_requests_finished_total"] > before["minichat_engine_requests_finished_total"]:
            break
        assert time.monotonic() < end, "the engine's counters never moved"
    label = 'minichat_http_requests_total{"endpoint": "chat", "outcome": "length"}'
    assert after[label] == before.get(label, 0) + 1
    assert after["minichat_generation_tokens_total"] - before["minichat_generation_tokens_total"] == 5
    assert after["minichat_prompt_tokens_total"] > before["minichat_prompt_tokens_total"]
    for h in ("minichat_time_to_first_token_seconds", "minichat_e2e_request_latency_seconds"):
        assert after[f"{h}_count"] == before[f"{h}_count"] + 1
    itl = "minichat_inter_token_latency_seconds_count"
    assert after[itl] >= before[itl] + 4
    assert after["minichat_engine_requests_submitted_total"] > before["minichat_engine_requests_submitted_total"]


def test_bench_openai_backend_reports_every_metric(server, tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(minichat("bench", "--backend", "openai", "--base-url", server.url, "--model", "tiny",
                                  "--api-key", KEY, "--num-requests", "4", "--concurrency", "2", "--input-len", "12",
                                  "--output-len", "4", "--warmup", "1", "--json", str(out)),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for label in ("completed / aborted / failed", "request throughput", "output throughput", "TTFT", "TPOT", "ITL",
                  "E2E"):
        assert label in run.stdout
    report = json.loads(out.read_text())
    assert report["config"]["backend"] == "openai" and report["engine"]["completed"] == 4
    assert [(r["prompt_len"], r["output_len"], r["error"]) for r in report["records"]] == [(12, 4, None)] * 4
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < report["engine"][m]["median"] <= report["engine"][m]["p99"], m


@pytest.mark.parametrize("endpoint", ["chat", "messages", "responses"])
def test_bench_streams_the_other_apis(server, tmp_path, endpoint):
    """--endpoint: the same workload through chat, Anthropic's Messages or the Responses API, counted from
    each one's usage (the chat template's tokens are the prompt's too)."""
    out = tmp_path / "bench.json"
    run = subprocess.run(minichat("bench", "--backend", "openai", "--base-url", server.url, "--model", "tiny",
                                  "--api-key", KEY, "--num-requests", "3", "--concurrency", "2", "--input-len", "12",
                                  "--output-len", "4", "--warmup", "0", "--endpoint", endpoint, "--json", str(out)),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["config"]["endpoint"] == endpoint and report["engine"]["completed"] == 3
    assert all(r["output_len"] == 4 and r["prompt_len"] > 12 and r["error"] is None for r in report["records"])
    assert report["engine"]["ttft_ms"]["median"] > 0


@pytest.fixture(scope="module")
def attached(llama_ckpt: Path) -> Iterator[tuple[str, subprocess.Popen, object]]:
    """`minichat api` (no key) attached to an engine of its own, which a test may stop."""
    address = f"ipc://{tempfile.mkdtemp(prefix='mca')}/engine.sock"
    handle = start(address, model=str(llama_ckpt), timeout=START_TIMEOUT)
    port = free_port()
    process = subprocess.Popen(minichat("api", "--address", address, "--port", str(port)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "MINICHAT_API_KEY": ""})
    try:
        wait_http(process, f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}", process, handle
    finally:
        stop(process)
        handle.stop()


def test_api_attaches_without_a_key_and_answers_503_when_the_engine_is_gone(attached):
    root, _, handle = attached
    sdk = openai.OpenAI(base_url=root + "/v1", api_key="anything", max_retries=0)
    model = sdk.models.list().data[0].id
    reply = sdk.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 2
    handle.stop()
    assert httpx.get(root + "/health", timeout=30).status_code == 503
    with pytest.raises(openai.InternalServerError) as e:
        sdk.completions.create(model=model, prompt="hi", max_tokens=2)
    assert_error(e.value, 503, code="engine_unavailable")


def test_api_refuses_a_remote_host_without_allow_remote():
    run = subprocess.run(minichat("api", "--host", "0.0.0.0", "--port", str(free_port())), capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "--allow-remote" in run.stderr and "Traceback" not in run.stderr


def test_bench_openai_backend_names_what_the_server_serves(server):
    run = subprocess.run(minichat("bench", "--backend", "openai", "--base-url", server.url, "--model", "nope",
                                  "--api-key", KEY, "--num-requests", "1"), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "serves ['tiny'], not 'nope'" in run.stderr and "Traceback" not in run.stderr


def test_priority_is_vllms_extension_and_checked(server):
    """`priority` reaches the engine (vLLM's spelling, through the SDK's extra_body); a value the engine
    cannot take is a 400 in the engine's words, not accepted and ignored."""
    reply = server.sdk().completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0,
                                            extra_body={"priority": -3, "ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        server.sdk().completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"priority": 2**40})
    assert "priority" in str(err.value)
