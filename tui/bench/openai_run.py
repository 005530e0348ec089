"""The openai backend of `minichat bench`: any OpenAI-compatible server (minichat's own HTTP API, vLLM,
SGLang, llama.cpp) or a gateway in front of some (smg), streamed `/v1/completions` (or, with
`--endpoint`, chat, Anthropic's Messages or the Responses API: endpoints.py). The prompt goes as
text that reads back as exactly the workload's tokens where the tokenizer can spell it (a gateway takes
no token ids), else as the ids, so every backend gets exactly the same tokens. Times are taken per SSE
chunk that carries text, as `vllm bench serve` does; token counts (and the prompt tokens the prefix cache
served, where the server says) come from the final usage chunk (`stream_options.include_usage`).
"""

from __future__ import annotations

import json
import time

import httpx

from tui.bench.endpoints import ENDPOINTS, Endpoint
from tui.bench.metrics import RequestRecord
from tui.bench.runner import run_workload
from tui.bench.workload import BenchRequest

COMPLETIONS = ENDPOINTS["completions"]  # what every OpenAI-compatible server and gateway streams


class OpenAIError(RuntimeError):
    """The server answered with an error status; the message is its error body's."""


def error_message(response: httpx.Response) -> str:
    try:
        return f"HTTP {response.status_code}: {response.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def client(base_url: str, api_key: str | None, timeout: float, connections: int = 100) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers, timeout=timeout,
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


async def _one(http: httpx.AsyncClient, model: str, req: BenchRequest, ignore_eos: bool, temperature: float,
               seed: int | None, json_schema: str | None, endpoint: Endpoint = COMPLETIONS) -> RequestRecord:
    body = endpoint.body(model, req.prompt_ids if req.text is None else req.text, req.output_len, temperature,
                         ignore_eos, seed, json_schema)
    record = RequestRecord(prompt_len=len(req.prompt_ids))
    chunks = 0
    finished = False  # a stream cut off before it said it ended failed, whatever else it sent
    start = last = time.perf_counter()
    async with http.stream("POST", endpoint.path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise OpenAIError(error_message(response))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = endpoint.read(json.loads(data))
            if event.error is not None:  # the server's error event for a stream it could not finish
                raise OpenAIError(event.error)
            finished |= event.finished
            record.aborted |= event.aborted
            now = time.perf_counter()
            if event.text:
                if record.ttft is None:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last)
                last = now
                chunks += 1
            record.prompt_len = event.prompt if event.prompt is not None else record.prompt_len
            record.output_len = event.output if event.output is not None else record.output_len
            record.cached = event.cached if event.cached is not None else record.cached
    if not finished:
        raise OpenAIError("the stream ended without a finish_reason (cut off)")
    record.e2e = time.perf_counter() - start
    record.output_len = record.output_len or chunks  # a server without usage in streams: one token a chunk
    return record


async def run_openai_bench(base_url: str, model: str, api_key: str | None, workload: list[BenchRequest],
                           concurrency: int, request_rate: float, seed: int, ignore_eos: bool, temperature: float,
                           timeout: float, json_schema: str | None = None, warmup: int = 0,
                           endpoint: str = "completions") -> tuple[list[RequestRecord], float, int]:
    """Returns per-request records, the measured duration and the peak number of requests in flight.
    `endpoint`: which API streams the workload (endpoints.py)."""
    api = ENDPOINTS[endpoint]
    async with client(base_url, api_key, timeout, concurrency) as http:
        return await run_workload(lambda req, s: _one(http, model, req, ignore_eos, temperature, s, json_schema, api),
                                  workload, concurrency, request_rate, seed, temperature, timeout, warmup)
