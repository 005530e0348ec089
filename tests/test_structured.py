"""Structured outputs (engine/structured.py): random logits sampled through the grammar's token masks
always produce text that matches the grammar; bad grammars are refused with a useful message."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from engine.structured import (
    GrammarCompiler,
    GrammarSpec,
    InvalidGrammar,
    apply_bitmask,
    fill_bitmask,
)
from engine.tokenizer import load_tokenizer

DEMO = Path(__file__).resolve().parent.parent / "engine" / "demo_model"
PADDED_VOCAB = 4096 + 32  # the demo tokenizer has 4096 tokens; a model may pad its logits beyond them
EOS = 0

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


def punctuation_boost(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> torch.Tensor:
    """Added to random logits so that random walks through a grammar end within tens of tokens: tokens
    that can close a string, an object or an array, and the stop tokens, are made ~400 times likelier."""
    boost = torch.zeros(vocab_size)
    for i in range(len(tokenizer)):
        if any(ch in tokenizer.decode([i]) for ch in '"}],'):
            boost[i] = 6.0
    boost[stop_token_ids] = 6.0
    return boost


def sample_through_grammar(compiler: GrammarCompiler, tokenizer, spec: GrammarSpec, rows: int = 20, seed: int = 0,
                           max_steps: int = 400) -> list[str]:
    """Sample `rows` outputs at once from seeded random logits (temperature 1) through the grammar's masks,
    one matcher per row plus an unconstrained row that must stay untouched, until every matcher has
    terminated; rows that finish early keep going with only their stop token allowed."""
    stop = compiler.stop_token_ids
    compiled = compiler.compile(spec)
    matchers = [compiler.matcher(compiled) for _ in range(rows)]
    bitmask = compiler.allocate_bitmask(rows + 1)
    boost = punctuation_boost(tokenizer, compiler.vocab_size, stop)
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(max_steps):
        if all(m.is_terminated for m in matchers):
            break
        logits = torch.randn(rows + 1, compiler.vocab_size, generator=gen) + boost
        applied = fill_bitmask(bitmask, [*matchers, None])
        assert applied == list(range(rows))
        apply_bitmask(logits, bitmask, applied)
        assert torch.isfinite(logits[rows]).all(), "a row without a matcher was masked"
        assert torch.isinf(logits[:rows, len(tokenizer):]).all(), "padding ids beyond the tokenizer were allowed"
        tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)[:, 0].tolist()
        for i, m in enumerate(matchers):
            if m.is_terminated:
                assert tokens[i] in stop, "a terminated matcher allowed more than its stop tokens"
                continue
            assert m.accept(tokens[i]), "a token sampled through the mask was rejected"
            if tokens[i] not in stop:
                out[i].append(tokens[i])
    else:
        pytest.fail(f"the random walks did not finish in {max_steps} steps")
    return [tokenizer.decode(ids) for ids in out]


@pytest.fixture(scope="module")
def demo_tokenizer():
    tok = load_tokenizer(DEMO)
    assert tok is not None and len(tok) == 4096
    return tok


@pytest.fixture(scope="module")
def compiler(demo_tokenizer) -> GrammarCompiler:
    pytest.importorskip("xgrammar")
    return GrammarCompiler(demo_tokenizer, vocab_size=PADDED_VOCAB, stop_token_ids=[EOS])


def test_json_schema_outputs_validate(compiler, demo_tokenizer) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    texts = sample_through_grammar(compiler, demo_tokenizer, GrammarSpec(kind="json_schema", value=json.dumps(PERSON)))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 10, "the samples should differ: the mask must not force one output"


def test_regex_outputs_fullmatch(compiler, demo_tokenizer) -> None:
    pattern = r"\d{3}-[a-z]+"
    for text in sample_through_grammar(compiler, demo_tokenizer, GrammarSpec(kind="regex", value=pattern), seed=1):
        assert re.fullmatch(pattern, text), text


def test_choice_outputs_one_of_the_choices(compiler, demo_tokenizer) -> None:
    choices = ["yes", "no", 'she said "maybe"\n', "naïve café"]
    texts = sample_through_grammar(compiler, demo_tokenizer, GrammarSpec(kind="choice", value=choices), seed=2)
    assert set(texts) <= set(choices) and len(set(texts)) > 1


def test_json_object_outputs_are_objects(compiler, demo_tokenizer) -> None:
    for text in sample_through_grammar(compiler, demo_tokenizer, GrammarSpec(kind="json_object"), seed=3):
        assert isinstance(json.loads(text), dict), text


def test_ebnf_grammar(compiler, demo_tokenizer) -> None:
    spec = GrammarSpec(kind="grammar", value='root ::= "(" [a-c]+ ")" | "none"')
    for text in sample_through_grammar(compiler, demo_tokenizer, spec, rows=8, seed=4):
        assert re.fullmatch(r"\([a-c]+\)|none", text), text


@pytest.mark.parametrize(("kind", "value", "says"), [
    ("json_schema", '{"type": "nope"}', "nope"),
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "string", "pattern": "(x"}}}', "parenthesis"),
    ("regex", "(ab", "parenthesis"),
    ("regex", "a{3,1}", "bound"),
    ("grammar", 'root ::= "a" | ', "grammar"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}', "nope"),
])
def test_invalid_grammars_are_refused_with_the_reason(compiler, kind, value, says) -> None:
    with pytest.raises(InvalidGrammar) as e:
        compiler.compile(GrammarSpec(kind=kind, value=value))
    message = str(e.value)
    assert says in message.lower() and ".cc:" not in message, message


@pytest.mark.parametrize(("fields", "says"), [
    ({"kind": "json_schema", "value": "{"}, "not valid JSON"),
    ({"kind": "json_schema", "value": "[1, 2]"}, "must be a JSON object"),
    ({"kind": "regex", "value": ""}, "non-empty string"),
    ({"kind": "choice", "value": "yes"}, "non-empty list"),
    ({"kind": "choice", "value": []}, "non-empty list"),
    ({"kind": "sql", "value": "SELECT"}, "kind must be one of"),
    ({"kind": "regex", "value": "a" * (1 << 19)}, "at most"),
])
def test_spec_shape_is_checked_on_construction(fields, says) -> None:
    with pytest.raises(InvalidGrammar, match=says):
        GrammarSpec(**fields)


def test_spec_travels_on_the_wire() -> None:
    spec = GrammarSpec(kind="choice", value=["a", "b"])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=GrammarSpec) == spec
    with pytest.raises(msgspec.ValidationError) as e:  # refused on decoding too, with the same reason
        msgspec.msgpack.decode(msgspec.msgpack.encode({"kind": "json_schema", "value": "{"}), type=GrammarSpec)
    assert isinstance(e.value.__cause__, InvalidGrammar)


def test_rollback_and_termination(compiler, demo_tokenizer) -> None:
    matcher = compiler.matcher(compiler.compile(GrammarSpec(kind="choice", value=["abc", "abd"])))
    ids = demo_tokenizer.encode("abc")
    assert all(matcher.accept(t) for t in ids)
    assert not matcher.accept(EOS + 5) and not matcher.is_terminated  # a token outside the grammar changes nothing
    bitmask = compiler.allocate_bitmask(2)
    logits = torch.zeros(2, PADDED_VOCAB)
    apply_bitmask(logits, bitmask, fill_bitmask(bitmask, [matcher, None]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]  # complete: only EOS may follow
    assert matcher.accept(EOS) and matcher.is_terminated
    matcher.rollback(1 + len(ids))  # back to the start: both choices are open again
    assert not matcher.is_terminated
    assert all(matcher.accept(t) for t in demo_tokenizer.encode("abd"))
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(len(ids) + 1)


def test_terminated_row_allows_only_stop_tokens(demo_tokenizer) -> None:
    pytest.importorskip("xgrammar")
    stops = [EOS, 31, 63, 4127]  # bits 0 and 31 of a word, and the last padded id
    compiler = GrammarCompiler(demo_tokenizer, vocab_size=PADDED_VOCAB, stop_token_ids=stops)
    matcher = compiler.matcher(compiler.compile(GrammarSpec(kind="choice", value=["x"])))
    assert matcher.accept(demo_tokenizer.encode("x")[0]) and matcher.accept(63) and matcher.is_terminated
    bitmask = compiler.allocate_bitmask(1)
    logits = torch.zeros(1, PADDED_VOCAB)
    apply_bitmask(logits, bitmask, fill_bitmask(bitmask, [matcher]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == stops


def test_without_xgrammar_the_error_says_how_to_get_it(demo_tokenizer, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # what an absent package looks like to `import`
    with pytest.raises(InvalidGrammar, match="structured output needs xgrammar: pip install xgrammar"):
        GrammarCompiler(demo_tokenizer, vocab_size=PADDED_VOCAB, stop_token_ids=[EOS])
    assert GrammarSpec(kind="regex", value="a+").value == "a+"  # specs need no xgrammar
