"""Write a randomly initialised HF checkpoint with the shape of a real model, for benchmarks.

Weights cannot be downloaded here, and throughput depends on shapes, not on what the weights
learned, so `minichat bench` numbers for "a 0.5B model" are measured on this stand-in.

    python scripts/make_random_checkpoint.py /tmp/qwen2.5-0.5b-random --shape qwen2.5-0.5b --dtype bfloat16
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

SHAPES = {
    # Qwen/Qwen2.5-0.5B's config.json: 494M parameters, tied embeddings, q/k/v bias, GQA 14:2.
    "qwen2.5-0.5b": lambda: Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643),
    # TinyLlama-1.1B's shape: 22 layers, GQA 32:4, untied head.
    "tinyllama-1.1b": lambda: LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = SHAPES[args.shape]()
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {params / 1e6:.0f}M parameters, {args.dtype} -> {args.out}")


if __name__ == "__main__":
    main()
