"""Structured output end to end: every sample of a random tiny model at temperature 1 follows its JSON
schema, regex or choice, sequential and overlapped, beside unconstrained requests; a grammar that
cannot work is refused before it queues."""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest

from engine import LLM, SamplingParams
from engine.params import InvalidParams
from engine.structured import GrammarSpec

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "kind", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "kind": {"enum": ["cat", "dog"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}


def constrained(spec: GrammarSpec, n: int = 1, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=400, temperature=1.0, seed=seed, n=n, structured=spec)


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints["qwen2"]))


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_twenty_json_schema_samples_validate(checkpoints, overlap):
    llm = LLM(str(checkpoints["qwen2"]), overlap=overlap)
    spec = GrammarSpec(kind="json_schema", value=json.dumps(SCHEMA))
    outs = llm.generate(["a", "b", "c", "d", "free"],
                        [constrained(spec, n=5, seed=s) for s in range(4)] + [SamplingParams(max_tokens=30)])
    samples = [o for o in outs if o.rid != outs[-1].rid]
    assert len(samples) == 20
    for out in samples:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    llm.check_integrity()


def test_json_object_regex_and_choice(llm):
    # a random model wanders in free JSON: a bias toward closing strings and objects keeps samples short
    closers = {llm.tokenizer.convert_tokens_to_ids(c): 4.0 for c in ('"', "}", "]")}
    params = msgspec.structs.replace(constrained(GrammarSpec(kind="json_object"), n=5), logit_bias=closers)
    for out in llm.generate(["x"], params):
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
    for out in llm.generate(["x"], constrained(GrammarSpec(kind="regex", value=r"\d{3}-[a-z]{2,5}"), n=5)):
        assert re.fullmatch(r"\d{3}-[a-z]{2,5}", out.text), out.text
    choices = ["yes", "no", "maybe so"]
    outs = llm.generate(["x"], constrained(GrammarSpec(kind="choice", value=choices), n=8))
    assert all(o.text in choices for o in outs)
    llm.check_integrity()


def test_a_grammar_that_cannot_work_is_refused_before_it_queues(llm):
    with pytest.raises(InvalidParams, match="structured"):
        llm.add_request("x", SamplingParams(structured=GrammarSpec(kind="regex", value="(unclosed")))
    with pytest.raises(InvalidParams, match="structured"):
        llm.add_request("x", SamplingParams(structured=GrammarSpec(kind="json_schema",
                                                                   value='{"type": "no-such-type"}')))
    assert not llm.has_unfinished()
