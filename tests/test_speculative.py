"""Speculative decoding (engine/speculative): drafts from prompt lookup or a draft model, verified by the
target in one step. Greedy output stays transformers' with each proposer on every architecture and under
every scheduler policy; sampled output keeps its distribution; stops, limits, grammars, aborts and the
counters behave as without speculation.

Three proposers are used: "ngram" (prompt lookup), "draft" (another tiny checkpoint of the family, same
tokenizer, other seed: its drafts are nearly all rejected) and "self" (the target as its own draft model:
greedy drafts all accepted). `speculative_adaptive=False` makes every request draft as much as the
proposer has, so verification is exercised on every step rather than where the cost model finds it pays.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from engine.config import DEMO_MODEL_DIR
from engine.outputs import RequestOutput
from engine.service.client import EngineClient
from engine.speculative.ngram import NgramIndex
from engine.speculative.policy import Offer, StepCosts, allocate
from engine.structured import GrammarSpec
from tests.checkpoints import FAMILIES, make_checkpoint, with_eos
from tests.real_model import smollm2_gguf
from tests.served import serve_http
from tests.test_retraction import assert_all_free, crowd, tight
from tui.status import summary

PROPOSERS = ("ngram", "draft", "self")
OUT = 24


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per family a draft checkpoint: the family's shape and tokenizer, another seed."""
    root = tmp_path_factory.mktemp("drafts")
    return {family: make_checkpoint(family, root / family, seed=1) for family in FAMILIES}


def speculating(proposer: str, target: Path, draft: Path | None = None) -> dict[str, object]:
    if proposer == "ngram":
        return {"speculative": "ngram", "speculative_adaptive": False}
    return {"speculative_model": str(target if proposer == "self" else draft), "speculative_adaptive": False}


def prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (prompt lookup proposes its continuation) and random ones."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(3, 380) for _ in range(rng.randint(5, 12))] for _ in range(3)]
    return [p * (48 // len(p)) for p in phrases] + [[rng.randrange(3, 380) for _ in range(n)] for n in (9, 30)]


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    c = llm.stats().counters
    return c.spec_drafts, c.spec_draft_tokens, c.spec_accepted_tokens


def assert_proposer_behaves(proposer: str, llm: LLM) -> None:
    """Verification happened; the self-draft's drafts were all accepted, the foreign draft's mostly not."""
    verifications, drafted, accepted = spec_counts(llm)
    assert verifications > 0 and drafted >= verifications
    if proposer == "self":
        assert accepted == drafted
    if proposer == "draft":
        assert accepted < drafted / 2


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_with_each_proposer(checkpoints, drafts, hf, family, proposer):
    """Chunked prefill (a 16-token budget for 48-token prompts) and mixed batches (the default) included."""
    path = checkpoints[family]
    llm = LLM(str(path), max_prefill_tokens=16, **speculating(proposer, path, drafts[family]))
    batch = prompts()
    outs = llm.generate(batch, SamplingParams(max_tokens=OUT))
    for prompt, out in zip(batch, outs, strict=True):
        hf.check_greedy(out.token_ids, path, prompt, OUT, eos=sorted(llm.eos_ids))
    assert_proposer_behaves(proposer, llm)
    assert_all_free(llm)


LOOPS = [(overlap, mixed) for overlap in (False, True) for mixed in (True, False)]


@pytest.mark.parametrize("proposer", ["ngram", "self"])
@pytest.mark.parametrize(("overlap", "mixed"), LOOPS,
                         ids=[f"{'overlap' if o else 'sequential'}-{'mixed' if m else 'unmixed'}" for o, m in LOOPS])
def test_retraction_and_every_loop_stay_exact(llama_ckpt, hf, proposer, overlap, mixed):
    """A pool too small for the crowd: requests are retracted (their draft K/V dropped with their pages) and
    resume; output is still transformers'."""
    llm = tight(llama_ckpt, overlap=overlap, mixed_batches=mixed, **speculating(proposer, llama_ckpt))
    batch = crowd()[:24]
    outs = llm.generate(batch, SamplingParams(max_tokens=32))
    for prompt, out in zip(batch, outs, strict=True):
        hf.check_greedy(out.token_ids, llama_ckpt, prompt, 32, eos=sorted(llm.eos_ids))
    assert llm.stats().counters.retractions >= 1
    assert_proposer_behaves(proposer, llm)
    assert_all_free(llm)


@pytest.mark.parametrize(("backend", "proposer"), [("torch", "self"), ("cpu", "self"), ("triton", "ngram")])
def test_every_attention_backend_verifies_multi_token_rows(llama_ckpt, hf, backend, proposer):
    """A verifying request is 1 + k query tokens over its cached prefix, beside one-token decode rows. Triton
    runs under its interpreter here, a kernel launch costing what a whole step does on the other backends, so
    there prompt lookup proposes (a repeated phrase) rather than a draft model's k passes of its own, for two
    prompts."""
    llm = LLM(str(llama_ckpt), attention_backend=backend, **speculating(proposer, llama_ckpt))
    batch = prompts(1)[2:4] if backend == "triton" else prompts(1)  # a repeated phrase beside a random prompt
    outs = llm.generate(batch, SamplingParams(max_tokens=16))
    for prompt, out in zip(batch, outs, strict=True):
        hf.check_greedy(out.token_ids, llama_ckpt, prompt, 16, eos=sorted(llm.eos_ids))
    assert_proposer_behaves(proposer, llm)


@pytest.mark.parametrize("proposer", ["ngram", "self"])
def test_tensor_parallel_two_ranks(llama_ckpt, hf, proposer):
    """The target split over two gloo ranks verifies as one; a draft model runs whole on rank 0."""
    with LLM(str(llama_ckpt), tensor_parallel_size=2, **speculating(proposer, llama_ckpt)) as llm:
        batch = prompts(2)
        outs = llm.generate(batch, SamplingParams(max_tokens=16))
        for prompt, out in zip(batch, outs, strict=True):
            hf.check_greedy(out.token_ids, llama_ckpt, prompt, 16, eos=sorted(llm.eos_ids))
        assert_proposer_behaves(proposer, llm)
        assert_all_free(llm)


@pytest.mark.parametrize("proposer", ["ngram", "self"])
def test_the_real_model_in_block_formats_decodes_the_same(proposer):
    """SmolLM2's Q4_1 file runs every layer in one C call for steps of a few rows, verification rows too.
    Quantized output is not transformers', so it is compared with the same model decoding without drafts,
    on a chat that quotes its prompt (prompt lookup's case)."""
    path = smollm2_gguf()
    chat = [{"role": "user", "content": "Repeat exactly: The quick brown fox jumps over the lazy dog, and the "
                                        "dog sleeps on in the sun."}]
    params = SamplingParams(max_tokens=32)
    plain = LLM(str(path)).generate([chat], params)[0]
    llm = LLM(str(path), **speculating(proposer, path))
    assert llm.execution["layers"] == "one C call a step"
    ours = llm.generate([chat], params)[0]
    assert ours.token_ids == plain.token_ids
    verifications, _, accepted = spec_counts(llm)
    assert verifications > 0 and accepted > 0


def test_stop_string_max_tokens_and_eos_inside_a_proposal(llama_ckpt, tmp_path):
    """The self-draft proposes four tokens a step, all accepted: a stop string, the length limit, a stop token
    and an EOS each fall inside a verified proposal, and the request ends exactly where it ends without
    speculation (with the same log-probabilities, computed from the verification's rows)."""
    prompt = prompts(3)[0]
    llm_plain = LLM(str(llama_ckpt))
    plain = llm_plain.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    spec = LLM(str(llama_ckpt), **speculating("self", llama_ckpt))
    stop = llm_plain.tokenizer.decode(plain.token_ids[9:11])
    for params in (SamplingParams(max_tokens=30, stop=[stop]), SamplingParams(max_tokens=11),
                   SamplingParams(max_tokens=13, stop_token_ids=[plain.token_ids[7]], logprobs=2)):
        ours, theirs = spec.generate([prompt], params)[0], llm_plain.generate([prompt], params)[0]
        assert (ours.token_ids, ours.text, ours.finish_reason) == (theirs.token_ids, theirs.text, theirs.finish_reason)
        assert [e.token_id for e in ours.logprobs or ()] == [e.token_id for e in theirs.logprobs or ()]
        for a, b in zip(ours.logprobs or (), theirs.logprobs or (), strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top]
    assert spec.generate([prompt], SamplingParams(max_tokens=30, stop=[stop]))[0].finish_reason == "stop"
    eos = plain.token_ids[10]
    ends = with_eos(llama_ckpt, tmp_path / "eos", [eos])
    ours = LLM(str(ends), **speculating("self", ends)).generate([prompt], SamplingParams(max_tokens=30))[0]
    assert ours.finish_reason == "stop" and ours.token_ids == plain.token_ids[: plain.token_ids.index(eos) + 1]
    assert_proposer_behaves("self", spec)
    assert_all_free(spec)


@pytest.mark.parametrize("proposer", ["ngram", "self"])
def test_json_schema_output_is_the_same_and_parses(proposer):
    """Drafts the grammar forbids are cut before verification; each verified row is masked as if the drafts
    before it were accepted; the grammar advances over accepted tokens only."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
                         "required": ["a", "b"], "additionalProperties": False})
    params = SamplingParams(max_tokens=48, structured=GrammarSpec(kind="json_schema", value=schema))
    batch = ["The numbers are 12 12 12 and the letters x yy x yy", "Describe the answer as JSON"]
    plain = LLM().generate(batch, params)
    llm = LLM(**speculating(proposer, DEMO_MODEL_DIR))
    outs = llm.generate(batch, params)
    for ours, theirs in zip(outs, plain, strict=True):
        assert (ours.token_ids, ours.finish_reason) == (theirs.token_ids, theirs.finish_reason)
        assert ours.finish_reason == "stop" and set(json.loads(ours.text)) == {"a", "b"}
    assert spec_counts(llm)[0] > 0
    assert_all_free(llm)


def chi_square_p(a: list[int], b: list[int]) -> float:
    """The p-value of Pearson's chi-square test that two samples of category counts share a distribution."""
    table = torch.tensor([a, b], dtype=torch.float64)
    keep = table.sum(0) > 0
    table = table[:, keep]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def test_speculative_sampling_keeps_the_token_distribution(tmp_path):
    """On a 16-token vocabulary, 400 sampled requests with the self-draft (greedy drafts, accepted only where
    the sample equals them) against 400 plain ones with other seeds: their tokens' distributions agree
    (chi-square p > 0.001); and with the same seeds speculation reproduces plain sampling's tokens."""
    path = make_checkpoint("llama", tmp_path / "tiny", tokenizer=False, vocab_size=16)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    plain, spec = LLM(str(path)), LLM(str(path), **speculating("self", path))

    def counts(llm: LLM, seeds: range) -> tuple[list[int], list[list[int]]]:
        outs = llm.generate([prompt] * len(seeds), [SamplingParams(max_tokens=8, temperature=1.0, seed=s,
                                                                   ignore_eos=True) for s in seeds])
        tally = [0] * 16
        for out in outs:
            for token in out.token_ids:
                tally[token] += 1
        return tally, [o.token_ids for o in outs]

    spec_tally, spec_tokens = counts(spec, range(400))
    plain_tally, _ = counts(plain, range(1000, 1400))
    assert chi_square_p(spec_tally, plain_tally) > 1e-3
    verifications, drafted, accepted = spec_counts(spec)
    assert verifications > 0 and 0 < accepted < drafted  # samples both took and refused drafts
    _, same_seeds = counts(plain, range(400))
    assert sum(a != b for a, b in zip(spec_tokens, same_seeds, strict=True)) <= 4  # float rounding at a boundary
    assert counts(spec, range(400))[1] == spec_tokens  # seeded runs reproduce


@pytest.mark.parametrize("proposer", ["ngram", "self"])
def test_penalties_and_n_choices_see_only_accepted_tokens(llama_ckpt, proposer):
    """Penalties count the tokens a request emitted, never its drafts, and each of n choices drafts and verifies on
    its own: greedy under repetition, presence and frequency penalties, n=3 seeded samples under penalties, and n=3
    without (penalised outputs leave the prompt's phrases, so prompt lookup finds nothing to draft there) give the
    tokens decoding without speculation gives (which test_sampling holds to transformers' processors)."""
    plain, spec = LLM(str(llama_ckpt)), LLM(str(llama_ckpt), **speculating(proposer, llama_ckpt))
    penalised = SamplingParams(max_tokens=OUT, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5,
                               frequency_penalty=0.3)
    choices = SamplingParams(max_tokens=OUT, ignore_eos=True, n=3, temperature=0.9, seed=7, presence_penalty=0.4,
                             frequency_penalty=0.2)
    repeating = SamplingParams(max_tokens=OUT, ignore_eos=True, n=3, temperature=0.5, seed=8)  # where ngram drafts
    for params in (penalised, choices, repeating):
        want = [(o.index, o.token_ids) for o in plain.generate(prompts(3), params)]
        got = [(o.index, o.token_ids) for o in spec.generate(prompts(3), params)]
        assert got == want
    verifications, drafted, accepted = spec_counts(spec)
    assert verifications > 0 and 0 < accepted <= drafted
    assert_all_free(spec)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_abort_while_drafts_are_verified_frees_everything(llama_ckpt, hf, overlap):
    """Aborted once its verification is scheduled: before it runs, or (overlap) after the next step was
    scheduled behind it; the step is processed, nothing of the victim's is kept, everyone else is exact."""
    llm = LLM(str(llama_ckpt), **speculating("self", llama_ckpt))
    scheduler = llm.scheduler
    victim_prompt, other_prompt = prompts(4)[0], prompts(4)[4]
    victim = llm.add_request(victim_prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    other = llm.add_request(other_prompt, SamplingParams(max_tokens=OUT))
    outputs: dict[str, list] = {victim: [], other: []}

    def process(batch, output) -> None:
        for out in scheduler.process(batch, output).outputs:
            outputs[out.rid].append(out)

    while True:
        batch = scheduler.schedule()
        assert batch is not None
        if victim in {batch.reqs[i].rid for i in batch.drafts}:
            break
        process(batch, llm.runner.run(batch))
    output = llm.runner.run(batch)
    behind = scheduler.schedule() if overlap else None
    assert behind is None or victim not in {r.rid for r in behind.reqs}  # verifying: not scheduled again
    llm.abort(victim)
    process(batch, output)
    if behind is not None:
        process(behind, llm.runner.run(behind))
    while llm.has_unfinished():
        for out in llm.step().outputs:
            outputs[out.rid].append(out)
    assert RequestOutput.collect(outputs[victim]).finish_reason == "abort"
    hf.check_greedy(RequestOutput.collect(outputs[other]).token_ids, llama_ckpt, other_prompt, OUT,
                    eos=sorted(llm.eos_ids))
    assert_all_free(llm)


def test_counters_add_up(llama_ckpt):
    """Per request (usage) and engine-wide (stats) the drafts add up; decode tokens are the output tokens
    decoding made (each request's first token comes from its prefill)."""
    llm = LLM(str(llama_ckpt), speculative="ngram")
    outs = llm.generate(prompts(5) * 2, SamplingParams(max_tokens=OUT))
    c = llm.stats().counters
    assert c.spec_draft_tokens == sum(o.usage.draft_tokens for o in outs) > 0
    assert c.spec_accepted_tokens == sum(o.usage.accepted_tokens for o in outs)
    assert c.spec_accepted_tokens <= c.spec_draft_tokens and c.spec_drafts <= c.spec_draft_tokens
    assert c.decode_tokens == sum(o.usage.completion_tokens for o in outs) - len(outs)


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    index = NgramIndex(2, 3)
    read = lambda a, b: seq[a:b]  # noqa: E731
    assert index.propose(read, len(seq), 4) == [7, 8, 1, 2]  # "1 2 3" last seen before 7 8
    assert index.propose(read, 3, 4) == []  # nothing earlier to match
    seq.append(4)
    assert NgramIndex(2, 3).propose(lambda a, b: seq[a:b], len(seq), 2) == []  # "2 3 4" / "3 4" never occurred


def test_the_cost_model_drafts_only_where_it_pays():
    """A single stream on a memory-bound device (steps barely longer with more tokens) gets drafts; the same
    request on a compute-bound one (time grows with every token), or with hopeless acceptance, gets none."""
    flat, steep = StepCosts(), StepCosts()
    for n in range(1, 40):
        for _ in range(2):  # the first of each count builds its kernels: not learnt from
            flat.record(n, 1.0 + 0.02 * n)
            steep.record(n, float(n))
    assert allocate([Offer(0, 4, 0.8)], flat, 1, 1) == {0: 4}
    assert allocate([Offer(0, 4, 0.8)], steep, 1, 1) == {}
    assert allocate([Offer(0, 4, 0.01)], flat, 1, 1) == {}
    batch = [Offer(i, 4, 0.8) for i in range(32)]
    assert sum(allocate(batch, steep, 32, 32).values()) == 0


def test_slow_first_measurements_do_not_price_drafting_out_for_good(llama_ckpt):
    """Only drafting measures what drafting costs, so a cost once measured high would never be measured again:
    a step count's first step (it builds that shape's kernels) is not learnt from, and the draft pass's time,
    once timed slow (a busy machine), falls a little with every step that runs no pass, until drafting is tried
    again."""
    costs = StepCosts()
    costs.record(2, 50.0)  # the first 2-token step: kernels built
    assert allocate([Offer(0, 4, 0.8)], costs, 1, 1) != {}
    costs.record(2, 1.05)
    assert costs.estimate(2) == 1.05
    assert allocate([Offer(0, 4, 0.8)], costs, 1, 1, passes=StepCosts(first=0.0)) != {}  # passes never timed
    llm = LLM(str(llama_ckpt), speculative_model=str(llama_ckpt))
    passes = llm.scheduler.speculator.proposer.pass_costs
    for _ in range(2):
        passes.record(1, 1.0)  # a second a pass, against a millisecond idle
    assert allocate([Offer(0, 4, 0.8)], costs, 1, 1, passes) == {}
    for _ in range(300):
        llm.scheduler.speculator.proposer.propose({})  # a step that drafted nothing
    assert passes.estimate(1) < 0.003 and allocate([Offer(0, 4, 0.8)], costs, 1, 1, passes) != {}


def test_a_draft_pass_is_priced_by_the_requests_it_carries():
    """A full batch's drafts each add a row to passes that carry many requests: where the draft model's pass
    grows with its rows as the target's step does, a full batch is given fewer drafts than one stream."""
    steps, passes = StepCosts(), StepCosts(first=0.0)
    for n in range(1, 200):
        for _ in range(2):
            steps.record(n, 10.0 + 0.5 * n)
            passes.record(n, 1.0 + 0.5 * n)
    single = allocate([Offer(0, 4, 0.9)], steps, 1, 1, passes)
    batch = allocate([Offer(i, 4, 0.9) for i in range(32)], steps, 32, 32, passes)
    assert single == {0: 4} and sum(batch.values()) < 32


@pytest.fixture(scope="module")
def spec_server(long_ckpt: Path):
    yield from serve_http(long_ckpt, "--speculative", "ngram", "--no-speculative-adaptive")


def test_speculation_is_visible_in_metrics_status_and_request_detail(spec_server, long_ckpt):
    root, address = spec_server
    sdk = openai.OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
    prompt = "To be, or not to be, that is the question. To be, or not to be, that is the question. To be,"
    reply = sdk.completions.create(model="m", prompt=prompt, max_tokens=40, temperature=0)
    plain = LLM(str(long_ckpt)).generate([prompt], SamplingParams(max_tokens=40))[0]
    assert reply.choices[0].text == plain.text
    with EngineClient(address) as client:
        stats = client.wait_stats(lambda s: s.counters.spec_drafts > 0 and not s.running)
        info = client.info()
    assert "speculative" in info.execution and info.execution["speculative"].startswith("prompt lookup")
    c = stats.counters
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(root + "/metrics", timeout=10).text)}
    for name, value in (("vllm:spec_decode_num_drafts", c.spec_drafts),
                        ("vllm:spec_decode_num_draft_tokens", c.spec_draft_tokens),
                        ("vllm:spec_decode_num_accepted_tokens", c.spec_accepted_tokens)):
        assert families[name].samples[0].value == value
    assert any(line.startswith("speculative: ") for line in summary(stats, info))


def test_one_request_a_step_starts_a_draft_model_over():
    """A draft model that has not seen a request must catch up on it (its whole prompt the first time) before it
    drafts, which pays only if drafting then goes on: one request a step starts over, while those it keeps up
    with (a token or two unseen) all draft, and prompt lookup, which feeds nothing, is not held back."""
    flat = StepCosts()
    for n in range(1, 80):
        for _ in range(2):
            flat.record(n, 1.0 + 0.01 * n)
    fresh = [Offer(i, 4, 0.8, feeds=60) for i in range(32)]
    assert len(allocate(fresh, flat, 32, 32, StepCosts(first=0.0))) == 1
    kept_up = [Offer(i, 4, 0.8, feeds=2) for i in range(32)]
    assert len(allocate(kept_up, flat, 32, 32, StepCosts(first=0.0))) == 32
    lookup = [Offer(i, 4, 0.8, feeds=0) for i in range(32)]
    assert len(allocate(lookup, flat, 32, 32)) == 32
