"""The batched sampler: each logits processor against a per-row reference on fixed logits, the draw's
distribution and reproducibility, and the sampling parameters end to end (n choices, penalties vs
transformers, logit_bias, min_tokens, stop_token_ids)."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv.request_kv import RequestKV
from engine.request import Req
from engine.sampling import SamplingBatch, draw, process_logits, sample
from tests.checkpoints import with_eos
from tests.test_engine_correctness import mixed_prompts

VOCAB = 12
EOS = {11}


def make_reqs(params: list[SamplingParams], histories: list[tuple[list[int], list[int]]]) -> list[Req]:
    """Requests in slots 0.. with prompt and output so far as given, and their token table."""
    reqs = []
    for slot, (p, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
        req = Req(rid=str(slot), uid=slot, input_ids=prompt, params=p, max_output=50, seed=slot,
                  kv=RequestKV(slot=slot))
        req.output_ids, req.sampled = list(output), len(output)
        reqs.append(req)
    return reqs


def token_table(reqs: list[Req]) -> torch.Tensor:
    table = torch.zeros(len(reqs), 32, dtype=torch.int64)
    for r in reqs:
        seq = r.input_ids + r.output_ids
        table[r.kv.slot, : len(seq)] = torch.tensor(seq)
    return table


def reference(row: torch.Tensor, p: SamplingParams, req: Req) -> torch.Tensor:
    """One row through the processors in vLLM's order, written plainly."""
    row = row.clone()
    if req.sampled < p.min_tokens:
        for t in EOS | set(p.stop_token_ids or ()):
            row[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    seen = set(req.input_ids) | set(req.output_ids)
    for t in range(VOCAB):
        if t in seen:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        count = req.output_ids.count(t)
        row[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    row = row / (p.temperature or 1.0)
    probs = torch.softmax(row, -1)
    if p.min_p:
        row[probs < p.min_p * probs.max()] = -math.inf
    order = row.argsort(descending=True, stable=True)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    kept_probs = torch.softmax(row[order][: p.top_k if p.top_k > 0 else VOCAB], -1)
    mass = 0.0
    for rank, t in enumerate(order[: len(kept_probs)].tolist()):
        if rank == 0 or mass < p.top_p:
            keep[t] = True
        mass += kept_probs[rank].item()
    return row.masked_fill(~keep, -math.inf)


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.2, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(temperature=0.5, repetition_penalty=1.7),
    SamplingParams(temperature=1.0, frequency_penalty=-1.0, repetition_penalty=0.8),
    SamplingParams(logit_bias={2: 5.0, 7: -100.0}),
    SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[3], logit_bias={11: 50.0}),
    SamplingParams(),
]


def test_each_processor_matches_the_reference_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB, generator=g) * 3
    histories = [(torch.randint(0, VOCAB, (5,), generator=g).tolist(),
                  torch.randint(0, VOCAB, (3,), generator=g).tolist()) for _ in CASES]
    reqs = make_reqs(CASES, histories)
    batch = SamplingBatch.build(reqs, EOS, torch.device("cpu"))
    got = process_logits(logits, batch, token_table(reqs))
    for i, (p, req) in enumerate(zip(CASES, reqs, strict=True)):
        want = reference(logits[i], p, req)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), f"case {i}: {p}"
        finite = ~torch.isinf(want)
        torch.testing.assert_close(got[i][finite], want[finite], msg=f"case {i}: {p}")
    tokens = sample(logits, batch, token_table(reqs))
    for i, p in enumerate(CASES):
        assert not torch.isinf(got[i, tokens[i]]), f"case {i} sampled a masked token"
        if p.greedy:
            assert tokens[i] == got[i].argmax()


def test_draws_follow_the_distribution_and_repeat_with_the_seed():
    """4,000 draws at distinct positions land on each token at its probability (within 4 sigma)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, -3.0]])
    probs = torch.softmax(logits[0], -1)
    p = SamplingParams(temperature=1.0)
    counts = torch.zeros(6)
    for position in range(4000):
        req = Req(rid="r", uid=0, input_ids=[1] * position or [1], params=p, max_output=1, seed=7, kv=RequestKV(slot=0))
        batch = SamplingBatch.build([req], set(), torch.device("cpu"))
        counts[sample(logits, batch, torch.zeros(1, 1, dtype=torch.int64))] += 1
    sigma = (4000 * probs * (1 - probs)).sqrt()
    assert ((counts - 4000 * probs).abs() <= 4 * sigma + 1).all(), (counts, 4000 * probs)
    assert draw(7, 10) == draw(7, 10) and draw(7, 10) != draw(8, 10) and draw(7, 10) != draw(7, 11)
    assert all(0.0 <= draw(s, q) < 1.0 for s in (-(2**63), 0, 2**64 - 1) for q in (0, 10**9))


def test_n_choices_share_the_prompt_and_reproduce(checkpoints):
    llm = LLM(str(checkpoints["qwen2"]))
    prompt = mixed_prompts(1, seed=31, max_len=2)[0] + list(range(100, 164))
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    before = llm.stats().counters.prefill_tokens
    outs = llm.generate([prompt], params)
    computed = llm.stats().counters.prefill_tokens - before
    assert [o.index for o in outs] == [0, 1, 2, 3] and {o.rid for o in outs} == {outs[0].rid}
    assert len({tuple(o.token_ids) for o in outs}) == 4, "the choices should differ"
    # the prompt is computed once: the other choices recompute at most its last partial page each
    assert computed < len(prompt) + 3 * llm.config.kv.page_size, computed
    again = llm.generate([prompt], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert single.token_ids == outs[2].token_ids  # choice i draws with seed + i
    llm.check_integrity()


def test_n_choices_end_apart_and_abort_together(checkpoints):
    llm = LLM(str(checkpoints["llama"]))
    rid = llm.add_request(list(range(1, 30)), SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=50,
                                                             ignore_eos=True))
    outputs = []
    for _ in range(4):
        outputs += llm.step().outputs
    llm.abort(rid)
    while llm.has_unfinished():
        outputs += llm.step().outputs
    ends = [o for o in outputs if o.finished or getattr(o, "finish_reason", None)]
    assert sorted(o.index for o in ends) == [0, 1, 2] and all(o.finish_reason == "abort" for o in ends)
    assert sum(o.finished for o in outputs) == 1  # one Final ends the request
    llm.check_integrity()


def test_repetition_penalty_greedy_equals_transformers(checkpoints, hf):
    path = checkpoints["llama"]
    llm = LLM(str(path))
    model = hf.model(path)
    for prompt in mixed_prompts(3, seed=32, max_len=25):
        out = llm.generate([prompt], SamplingParams(max_tokens=12, repetition_penalty=1.8, ignore_eos=True))[0]
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want


def test_penalties_bias_min_tokens_and_stop_tokens_end_to_end(checkpoints, tmp_path):
    llm = LLM(str(checkpoints["qwen3"]))
    prompt = mixed_prompts(1, seed=33, max_len=20)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    penalised = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                                                      presence_penalty=2.0))[0].token_ids
    assert max(penalised.count(t) for t in penalised) < max(plain.count(t) for t in plain)
    forced = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={77: 100.0}))[0]
    assert forced.token_ids == [77] * 5
    stop_at = plain[3]
    stopped = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == plain[: plain.index(stop_at) + 1] and stopped.finish_reason == "stop"
    # an EOS the model would say first is held back until min_tokens
    eos_llm = LLM(str(with_eos(checkpoints["qwen3"], tmp_path / "eos", [plain[0]])))
    assert eos_llm.generate([prompt], SamplingParams(max_tokens=24))[0].token_ids == [plain[0]]
    held = eos_llm.generate([prompt], SamplingParams(max_tokens=24, min_tokens=6))[0]
    assert len(held.token_ids) >= 6 and plain[0] not in held.token_ids[:6]
    with pytest.raises(ValueError, match="token ids in"):
        llm.add_request(prompt, SamplingParams(logit_bias={10**7: 1.0}))


def test_unseeded_requests_differ_between_engines_unless_the_engine_is_seeded(checkpoints):
    """Replicas behind a gateway must not sample in lockstep; `seed` keeps a run reproducible."""
    path = str(checkpoints["llama"])
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def first(**engine: int) -> list[int]:
        return LLM(path, **engine).generate([[1, 2, 3]], params)[0].token_ids

    assert first() != first()
    assert first(seed=7) == first(seed=7)
