"""How close minichat's quantized kernels come to the float model, on a real GGUF file and real text.

    python scripts/gguf_quality.py                      # Gemma 3 270M Q4_K_M (tests/real_model.py), 1,024 tokens
    python scripts/gguf_quality.py --file smollm2 --tokens 512
    python scripts/gguf_quality.py --file PATH.gguf

On the prose of tests/data/prose.txt, three models score every position: minichat with the file's weights kept in
their block formats, minichat with them expanded to float32 (`--dequantize`), and transformers loading the same
file (dequantized to float32: the reference). Printed: the share of positions where each one's top token is the
reference's, each one's perplexity, and the largest gap between the dequantized model's log-probabilities of the
text's tokens and the reference's (float32 rounding: ~1e-5).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402
from tests.real_model import gemma3_gguf, smollm2_gguf  # noqa: E402

KNOWN = {"gemma3": gemma3_gguf, "smollm2": smollm2_gguf}


def scored(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top token and log-probability of the text's next token at every position but the last."""
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs[1:]
    return torch.tensor([p.top[0][0] for p in out]), torch.tensor([p.logprob for p in out])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", default="gemma3", help=f"{' or '.join(KNOWN)}, or a .gguf path")
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    path = KNOWN[args.file]() if args.file in KNOWN else Path(args.file)
    quantized = LLM(str(path), max_prefill_tokens=4096)
    ids = quantized.tokenizer.encode((ROOT / "tests" / "data" / "prose.txt").read_text())[:args.tokens]
    rows = {"minichat, blocks": scored(quantized, ids)}
    del quantized
    rows["minichat, --dequantize"] = scored(LLM(str(path), dequantize=True, max_prefill_tokens=4096), ids)
    from transformers import AutoModelForCausalLM

    began = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    print(f"transformers loaded {path.name} in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)[:-1]
    rows["transformers"] = reference.argmax(-1), reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    print(f"{path.name}, {len(ids)} tokens of tests/data/prose.txt")
    print(f"{'':24} {'top-1 = reference':>18} {'perplexity':>11}")
    for name, (top, logprobs) in rows.items():
        agree = (top == rows["transformers"][0]).float().mean().item()
        print(f"{name:24} {100 * agree:17.2f}% {math.exp(-logprobs.mean().item()):11.4f}")
    gap = (rows["minichat, --dequantize"][1] - rows["transformers"][1]).abs().max().item()
    print(f"largest |log-prob gap|, --dequantize vs transformers: {gap:.2e}")


if __name__ == "__main__":
    main()
