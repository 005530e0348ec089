"""Tiny random HF checkpoints, made with a fixed seed, for tests to load into both engines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
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
WINDOW = 12
"""The sliding window of the windowed test checkpoints: the tests' prompts (up to ~70 tokens) span several."""
NEW_FAMILIES = {
    # one dense layer between two sparse ones (mlp_only_layers), top-k weights renormalised
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1])),
    # a shared expert beside the routed ones; q/k/v biases; top-k weights as the softmax gave them
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        norm_topk_prob=False)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2,
                                                        intermediate_size=32, tie_word_embeddings=False)),
    # a local layer and a global one; capped scores and logits (caps small enough to bite at these magnitudes)
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_logit_softcapping=0.5,
        final_logit_softcapping=3.0, layer_types=["sliding_attention", "full_attention"])),
    # local and global layers with their own RoPE bases, q/k norms
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention"])),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(tie_word_embeddings=False)),
    # every layer windowed: pages before the window are released early
    "mistral_window": (MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW)),
    "mixtral_window": (MixtralConfig, MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=WINDOW)),
}
FAMILIES |= NEW_FAMILIES
OFFSET_NORMS = ("gemma2", "gemma3")
"""Families whose RMSNorm scales by 1 + weight and whose transformers init leaves the weight zero: the checkpoints
get random ones, so that the offset is tested."""


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


def make_checkpoint(family: str, out: Path, seed: int = 0, tokenizer: bool = True, **overrides: object) -> Path:
    """A tiny random `family` checkpoint (its config: COMMON, the family's switches, then `overrides`)."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides})
    model = model_cls(config).eval()
    if family in OFFSET_NORMS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3)
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


# Chat templates without a system role, as some real ones are: Gemma's refuses a system message, others drop it.
NO_SYSTEM_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                      "{% endif %}{% for m in messages %}<|user|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|user|>assistant: {% endif %}")
DROPS_SYSTEM_TEMPLATE = ("{% for m in messages if m['role'] != 'system' %}<|user|>{{ m['role'] }}: {{ m['content'] }}"
                         "\n{% endfor %}{% if add_generation_prompt %}<|user|>assistant: {% endif %}")


def instruct_view(src: Path, out: Path, generation: dict[str, object], chat_template: str | None = None) -> Path:
    """A copy of `src` named as `out` is (its model id), as an instruct checkpoint ships: a generation_config.json
    recommending sampling settings (`generation`), and a chat template of its own if given."""
    shutil.copytree(src, out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, **generation}))
    if chat_template is not None:
        tok = PreTrainedTokenizerFast.from_pretrained(out)
        tok.chat_template = chat_template
        tok.save_pretrained(out)
    return out


LONG_CONTEXT = 65536
"""The context of the tests' long tiny llama (conftest.long_ckpt): a request of UNTIL_ABORTED tokens runs until the
test aborts it."""
UNTIL_ABORTED = 64000
"""max_tokens of a request meant to run until aborted: ~150 s of decoding on an idle machine (the tiny llama runs a
step in one C call; 16,000 tokens took 10 s, less than some tests hold one)."""


def with_context(src: Path, out: Path, max_positions: int) -> Path:
    """A copy of `src` whose config allows `max_positions` positions (RoPE extends without retraining)."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (out / "config.json").write_text(json.dumps(config))
    return out


# Tool-aware chat templates in the two families engine/tools.py parses, written for these tests after
# the shape of the real ones: Qwen2.5's (tools listed in <tools>, calls in <tool_call> tags, results as
# <tool_response>) and Llama 3.1's (tools as JSON in the system turn, a call as {"name", "parameters"}).
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for call in m.tool_calls %}{%- set f = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) "
    "+ '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TOOLS_TEMPLATE = (
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n\\nYou have access to the following functions. To call a function, "
    "respond with JSON in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.\\n\\n' }}{%- for t in tools %}{{- (t | tojson) + '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}{%- set f = m.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + f.name + '\", \"parameters\": ' "
    "+ (f.arguments | tojson) + '}<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- elif m.role != 'system' %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def make_tools_tokenizer(out: Path, chat_template: str) -> Path:
    """The test tokenizer with a tool-aware chat template (QWEN_TOOLS_TEMPLATE or LLAMA3_TOOLS_TEMPLATE)."""
    make_tokenizer(out)
    tok = PreTrainedTokenizerFast.from_pretrained(out)
    tok.chat_template = chat_template
    tok.save_pretrained(out)
    return out


THINKING_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")


def make_thinking_tokenizer(out: Path, chat_template: str) -> Path:
    """The test tokenizer with a reasoning model's markers as added tokens, as Qwen3's has them (`<think>`
    and `</think>` one token each and not special, so their text is decoded; `<|im_end|>` special, the EOS)
    and `chat_template` (a real one: tests/real_templates.py). Its vocabulary is VOCAB + 6 tokens: the
    model needs `vocab_size=THINKING_VOCAB`."""
    make_tokenizer(out)
    tok = PreTrainedTokenizerFast.from_pretrained(out)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.chat_template = chat_template
    tok.save_pretrained(out)
    return out


THINKING_VOCAB = VOCAB + len(THINKING_TOKENS)
