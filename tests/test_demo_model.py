"""The embedded demo model: the default checkpoint, exact against transformers, and readable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import DEMO_MODEL_DIR

CHATS = [
    [{"role": "user", "content": "What say you, good sir?"}],
    [{"role": "user", "content": "Who goes there?"}],
    [{"role": "system", "content": "You are the Prince of Denmark."},
     {"role": "user", "content": "How now, my lord? Why so sad?"}],
    [{"role": "user", "content": "Speak, friend."}, {"role": "assistant", "content": "I will, my lord."},
     {"role": "user", "content": "Then tell me of the king."}],
]
WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM()  # no model given: the embedded demo model


def test_default_model_is_the_embedded_demo(demo):
    assert demo.checkpoint.path == DEMO_MODEL_DIR
    assert demo.model.spec.architecture == "LlamaForCausalLM"
    assert demo.model.spec.num_kv_heads < demo.model.spec.num_heads  # GQA
    assert sum(f.stat().st_size for f in DEMO_MODEL_DIR.iterdir()) <= 16 * 2**20


def test_transformers_loads_the_same_directory():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR)
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert tok.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)


def test_greedy_chat_replies_equal_transformers(demo, hf):
    outs = demo.generate(CHATS, SamplingParams(max_tokens=40))
    assert len(outs) == len(CHATS)
    for out in outs:
        hf.check_greedy(out.token_ids, Path(DEMO_MODEL_DIR), out.prompt_token_ids, 40, eos=sorted(demo.eos_ids))
    assert any(o.finish_reason == "stop" for o in outs)  # the model learned to end its turn


def test_replies_are_words_from_the_training_corpus(demo):
    corpus = set((Path(__file__).parent / "data" / "shakespeare_words.txt").read_text().split())
    params = [SamplingParams(max_tokens=60)] * len(CHATS) + [
        SamplingParams(max_tokens=60, temperature=0.8, top_p=0.95, seed=10 * s, n=3) for s in range(len(CHATS))]
    outs = demo.generate(CHATS + CHATS, params)
    words = [w for o in outs for w in WORD.findall(o.text.lower())]
    assert len(words) >= 40
    known = sum(w in corpus for w in words) / len(words)
    assert known >= 0.85, f"only {known:.0%} of reply words occur in the corpus: {[o.text for o in outs]}"
