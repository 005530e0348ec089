"""Tiny random HF checkpoints, made with a fixed seed, for tests to load into both engines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 384
CORPUS = [
    "To be, or not to be, that is the question.",
    "The quick brown fox jumps over the lazy dog; héllo wörld, naïve café, 日本語のテキスト.",
    "Continuous batching lets new requests use a slot as soon as another request finishes.",
    "Pages of sixteen tokens hold the keys and values; the radix tree shares common prefixes.",
] * 50

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None, num_key_value_heads=1)),
}


def make_tokenizer(out: Path) -> None:
    """A small byte-level BPE tokenizer, so text prompts, stop strings and UTF-8 streaming get tested."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=["<|end|>", "<|user|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = ("{% for m in messages %}<|user|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|user|>assistant: {% endif %}")
    fast.save_pretrained(out)


def make_checkpoint(family: str, out: Path, seed: int = 0, tokenizer: bool = True) -> Path:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra})
    model = model_cls(config).eval()
    model.save_pretrained(out)
    if tokenizer:
        make_tokenizer(out)
    return out


def with_eos(src: Path, out: Path, eos: list[int]) -> Path:
    """A view of `src` whose generation_config.json declares `eos` (files are symlinked)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out


def with_context(src: Path, out: Path, max_positions: int) -> Path:
    """A copy of `src` whose config allows `max_positions` positions (RoPE extends without retraining)."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (out / "config.json").write_text(json.dumps(config))
    return out
