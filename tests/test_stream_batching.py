"""Batched stream deltas against a real engine process, overlapped and not: one `outputs` message per
client per step carries every token of every request of that client, in order, exactly once; aborting
one request stops only that one."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.service.launcher import EngineHandle, start
from tests.wire import pack, raw_dealer, reply

ENGINE = dict(max_running_requests=16, num_pages=256)
PROMPTS = [[(i * 11 + k) % 380 + 2 for k in range(2 + i)] for i in range(8)]
VICTIM = [5, 6, 7]
MAX_TOKENS = 200  # long enough that the others still stream when the victim's abort lands


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sequential"])
def served(request: pytest.FixtureRequest, long_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineHandle:
    runtime = tmp_path_factory.mktemp("rt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(runtime))
        handle = start(f"ipc://{runtime}/engine.sock", model=str(long_ckpt), overlap=request.param, **ENGINE)
        yield handle
        handle.stop()


def test_many_requests_one_client_every_token_once_in_order(served: EngineHandle, long_ckpt: Path) -> None:
    with raw_dealer(served.address) as sock:
        sock.send(pack({"type": "submit", "rid": "victim", "token_ids": VICTIM,
                        "params": {"max_tokens": 5000, "ignore_eos": True}}))
        for i, prompt in enumerate(PROMPTS):
            sock.send(pack({"type": "submit", "rid": f"r{i}", "token_ids": prompt,
                            "params": {"max_tokens": MAX_TOKENS, "ignore_eos": True}}))
        tokens: dict[str, list[int]] = defaultdict(list)
        finals: dict[str, dict] = {}
        widest = 0
        after_victim = 0  # items of other requests that arrived after the victim's final
        acked = abort_sent = False
        while len(finals) < len(PROMPTS) + 1 or not acked:
            msg = reply(sock, timeout=30.0)
            if msg["type"] == "aborted":
                acked = msg["rid"] == "victim"
                continue
            assert msg["type"] == "outputs", msg
            rids = [item["rid"] for item in msg["items"]]
            assert len(rids) == len(set(rids)), "a request appears twice in one step's message"
            widest = max(widest, len(rids))
            for item in msg["items"]:
                rid = item["rid"]
                assert rid not in finals, f"{rid} got output after its final"
                tokens[rid] += item["token_ids"]
                if item["type"] == "final":
                    finals[rid] = item
                after_victim += "victim" in finals and rid != "victim"
            if not abort_sent and len(tokens["victim"]) >= 2:
                sock.send(pack({"type": "abort", "rid": "victim"}))
                abort_sent = True

    assert widest >= 2, "no step carried more than one request"
    expected = LLM(str(long_ckpt), **ENGINE).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for i, exp in enumerate(expected):
        assert tokens[f"r{i}"] == exp.token_ids and finals[f"r{i}"]["finish_reason"] == "length"
    victim = tokens["victim"]
    assert finals["victim"]["finish_reason"] == "abort" and 2 <= len(victim) < 5000
    alone = LLM(str(long_ckpt), **ENGINE).generate([VICTIM], SamplingParams(max_tokens=len(victim), ignore_eos=True))
    assert victim == alone[0].token_ids
    assert after_victim > 0, "the other requests were done before the abort: it proved nothing"
