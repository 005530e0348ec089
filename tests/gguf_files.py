"""Tiny GGUF files for the tests, written with gguf's own writer from the tiny HF checkpoints of
tests/checkpoints.py, in any of the tensor types minichat reads.

gguf quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 itself; it only dequantizes the K formats, so their blocks
are built here from ggml's documented layout (`k_blocks`: a plain min/max fit per sub-block, not ggml's
optimised search; the tests need valid blocks, not the best ones). Metadata and tensor names follow
llama.cpp's converter: Llama's (and Mistral's) q/k rows permuted for its RoPE, the byte-level BPE
vocabulary, merges and chat template under tokenizer.ggml.*, no output.weight for tied embeddings.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as G
from safetensors.torch import load_file

GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
             "qwen3": gguf.MODEL_ARCH.QWEN3, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "gemma2": gguf.MODEL_ARCH.GEMMA2,
             "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
             "mixtral": gguf.MODEL_ARCH.LLAMA}
SHIFTED_NORMS = ("gemma2", "gemma3")
"""Families whose norm weights llama.cpp's converter writes as 1 + w."""
EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+\.weight)")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _scale(x: np.ndarray) -> np.ndarray:
    """A super-block scale as the file stores it (f16), never zero (an all-zero block divides by it)."""
    return np.maximum(x.astype(np.float16), np.float16(2**-14)).astype(np.float32)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block into ggml's 12 bytes (the inverse of get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def k_blocks(x: np.ndarray, qtype: str) -> np.ndarray:
    """Rows of float32 `x` (columns a multiple of 256) as Q4_K, Q5_K or Q6_K blocks: uint8 [rows, bytes]."""
    rows = x.shape[0]
    sb = x.reshape(-1, 256).astype(np.float32)
    n = sb.shape[0]
    if qtype == "Q6_K":
        sub = sb.reshape(n, 16, 16)
        amax = np.abs(sub).max(-1)
        scale = amax / 31.5
        d = _scale(np.abs(scale).max(-1) / 127)
        sc = np.clip(np.round(scale / d[:, None]), -127, 127).astype(np.int8)
        step = d[:, None, None] * sc[..., None].astype(np.float32)
        q = np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)) + 32, 0, 63)
        q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # [half][quarter][i]: element half*128 + quarter*32 + i
        ql = ((q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4), (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4))
        ql_bytes = np.stack(ql, axis=2).reshape(n, 128)
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        blocks = np.concatenate([ql_bytes, qh.reshape(n, 64), sc.view(np.uint8), _f16(d)], axis=1)
        return blocks.reshape(rows, -1)
    levels = 15 if qtype == "Q4_K" else 31
    sub = sb.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = _scale(scale.max(-1) / 63)
    dmin = _scale(-lo.min(-1) / 63)
    sc = np.clip(np.round(scale / d[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None, None] * sc[..., None]
    shifted = sub + dmin[:, None, None] * mn[..., None]
    q = np.clip(np.round(np.divide(shifted, step, out=np.zeros_like(sub), where=step != 0)), 0, levels)
    q = q.astype(np.uint8).reshape(n, 4, 2, 32)  # [pair][low/high nibble][i]
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    parts = [_f16(d), _f16(dmin), _pack_k_scales(sc, mn)]
    if qtype == "Q5_K":
        bits = (q.reshape(n, 8, 32) >> 4) & 1
        parts.append((bits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def quantize_rows(x: np.ndarray, qtype: str) -> np.ndarray:
    """Float32 rows in `qtype`'s file layout (the float types as their own dtype)."""
    if qtype in K_TYPES:
        return k_blocks(x, qtype)
    if qtype == "BF16":
        return gguf.quantize(x, G.BF16)
    return gguf.quantize(x, G[qtype])


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_fields(writer: gguf.GGUFWriter, checkpoint: Path) -> None:
    """The checkpoint's byte-level BPE tokenizer under tokenizer.ggml.*, as llama.cpp's converter writes it."""
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    tok_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_add_bos_token(False)
    template = tok_config.get("chat_template")
    if template is None and (checkpoint / "chat_template.jinja").is_file():
        template = (checkpoint / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def _borrowed_tokenizer_fields(writer: gguf.GGUFWriter, source: Path, vocab_size: int) -> None:
    """Another GGUF file's tokenizer, its vocabulary padded with control tokens to `vocab_size` (a random
    model of a real model's shape, for benchmarks, gets a real tokenizer this way)."""
    reader = gguf.GGUFReader(source)
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = value + [f"<|pad_{i}|>" for i in range(vocab_size - len(value))]
        elif field.name == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.CONTROL)] * (vocab_size - len(value))
        writer.add_key_value(field.name, value, field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)


def _stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as float32 arrays, each projection of a layer's experts stacked into one
    [experts, rows, columns] array under the name without the expert's index (llama.cpp's ffn_*_exps)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, tensor in tensors.items():
        match = EXPERT.fullmatch(hf_name)
        if match:
            experts.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = tensor.float().numpy()
        else:
            out[hf_name] = tensor.float().numpy()
    return out | {name: np.stack([parts[e] for e in sorted(parts)]) for name, parts in experts.items()}


def _hyperparameters(writer: gguf.GGUFWriter, config: dict) -> None:
    """The model's shape and switches as llama.cpp's converter writes them."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    if config.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(cap):
            getattr(writer, f"add_{cap}")(config[cap])
    if "num_experts_per_tok" in config:  # a mixture of experts, as llama.cpp's converter describes one
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):  # Mixtral's experts are its feed-forward length
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def write_gguf(checkpoint: Path, out: Path, family: str, qtype: str | dict[str, str] = "F32",
               tokenizer_from: Path | None = None, sampling: dict[str, float] | None = None) -> Path:
    """`checkpoint` (a tests/checkpoints.py directory) as a GGUF file: every 2-D weight in `qtype` (or
    `qtype[name]` for a name's first match, by substring, with a "" default), 1-D tensors in F32; the
    tokenizer its own, or `tokenizer_from` another GGUF file's; `sampling`: llama.cpp's recommended settings
    (`temp`, `top_k`, ...: the `general.sampling.*` keys, written with gguf's own `add_sampling_*`)."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = GGUF_ARCH[family]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"{family}-tiny")  # transformers reads a llama file named mistral-* as Mistral
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    _hyperparameters(writer, config)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer_from is not None:
        _borrowed_tokenizer_fields(writer, tokenizer_from, config["vocab_size"])
    else:
        _tokenizer_fields(writer, checkpoint)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":  # llama.cpp's form of it: a divisor per frequency
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf_config = AutoConfig.from_pretrained(checkpoint)
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
        base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    permuted = arch == gguf.MODEL_ARCH.LLAMA
    for hf_name, x in _stacked_experts(load_file(checkpoint / "model.safetensors")).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        heads = config["num_attention_heads"] if ".q_proj." in hf_name else (
            config["num_key_value_heads"] if ".k_proj." in hf_name else 0)
        if permuted and heads:
            x = _permute(x, heads)
        if family in SHIFTED_NORMS and hf_name.endswith("norm.weight"):
            x = x + 1
        kind = qtype if isinstance(qtype, str) else next(v for k, v in qtype.items() if k in hf_name)
        if x.ndim >= 2 and x.shape[-1] % gguf.GGML_QUANT_SIZES[G[kind]][0]:
            kind = "Q8_0"  # rows too short for the format's block: as llama.cpp's quantizer falls back
        if x.ndim == 1 or kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(x))
        elif kind == "F16":
            writer.add_tensor(name, x.astype(np.float16))
        else:  # a stack of experts' rows quantized as the rows of one matrix, stacked again
            rows = quantize_rows(np.ascontiguousarray(x.reshape(-1, x.shape[-1])), kind)
            writer.add_tensor(name, rows.reshape(*x.shape[:-1], -1), raw_dtype=G[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
