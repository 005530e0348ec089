"""Decode throughput of a mixture of experts on the CPU: minichat against transformers, and against the dense model with
the same active parameters, at batch 1 and 32, beside the batch-1 floor of the bytes one token reads.

    python scripts/bench_moe.py /tmp/bench-moe                  # writes both checkpoints once (~5 + 2 GB), measures
    python scripts/bench_moe.py /tmp/bench-moe-tiny --shape tiny  # the script's own check: a minute

The MoE ("qwen3-30b-a3b-3l"): Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query heads of 128 over 4 KV heads, q/k
norms, 128 experts of 768 rows, 8 per token, vocab 151,936) with 3 of its 48 layers, 2.5 B parameters: 9.3 GiB in
float32 (`--dtype`, the default: what both engines run on a CPU without native bf16; saved as bf16; `--dtype
bfloat16` halves it where the CPU has AVX512-BF16 or AMX). With 6 layers (16.3 GiB) minichat ran, but transformers
was killed loading it: it holds the experts twice while it stacks them, past 24 GiB. Its dense equivalent is a
Qwen3 of the same attention whose MLP has the routed experts' rows (8 x 768 = 6,144): the same weights read per token
at batch 1, while 32 tokens reach some 112 of the 128 experts of a layer, 14 times as many. Each engine runs in a
process of its own (one model in memory at a time), on every core. A measurement: `--batch` prompts of `--prompt`
random tokens prefilled, then `--tokens` decode steps timed, after a warm-up of the same (minichat: its decode steps,
in the second of two rounds; transformers: generate of 1 + N tokens less generate of 1, the better of two each).

The floor: bytes a decode step reads at batch 1 (attention's and the router's weights, 8 experts' per MoE layer, the
output head; the embedding row is negligible) over the memory bandwidth measured here (a large copy), as tokens/s.
Writes the figures as JSON beside the checkpoints (`results.json`) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    "qwen3-30b-a3b-3l": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=3, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                             moe_intermediate_size=768, max_position_embeddings=4096),
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                 max_position_embeddings=512),
}


def write_checkpoints(out: Path, shape: str) -> tuple[Path, Path]:
    """The MoE and its dense equivalent, random (seed 0), in bf16, each written once."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    s = SHAPES[shape]
    common = {k: s[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "max_position_embeddings")}
    common |= dict(tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    moe = Qwen3MoeConfig(**common, num_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
                         moe_intermediate_size=s["moe_intermediate_size"], norm_topk_prob=True,
                         intermediate_size=s["num_experts_per_tok"] * s["moe_intermediate_size"])
    dense = Qwen3Config(**common, intermediate_size=s["num_experts_per_tok"] * s["moe_intermediate_size"])
    paths = []
    for name, config in (("moe", moe), ("dense", dense)):
        path = out / name
        if not (path / "config.json").is_file():
            torch.manual_seed(0)
            config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def bytes_per_token(model: Path, dtype: str) -> int:
    """Bytes of the weights one decode step reads at batch 1 in `dtype` (all of a dense model but its embedding; of
    an MoE, its experts only those a token is routed to)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    routed = getattr(config, "num_experts_per_tok", 0) / getattr(config, "num_experts", 1)
    total = 0.0
    for file in model.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                numel = torch.Size(f.get_slice(name).get_shape()).numel()
                if name == "model.embed_tokens.weight":
                    continue
                total += numel * (routed if ".experts." in name else 1.0)
    return int(total * torch.empty((), dtype=getattr(torch, dtype)).element_size())


def bandwidth() -> float:
    """Bytes/s of a large copy (read + write) on every core: the rate a decode step's weights stream at, at best."""
    src = torch.empty(2**28, dtype=torch.float32).fill_(1.0)  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        runs.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / min(runs)


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def measure_minichat(model: Path, batch: int, length: int, tokens: int, dtype: str) -> dict[str, object]:
    from engine import LLM, SamplingParams

    llm = LLM(str(model), dtype=dtype, max_running_requests=max(batch, 4), max_model_len=length + tokens + 8,
              prefix_cache="naive")
    for _ in range(2):  # the first round warms up: oneDNN builds a GEMM for each row count it meets
        for p in prompts(batch, length, llm.model.spec.vocab_size):
            llm.add_request(p, SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
        decode_time, decoded = 0.0, 0
        while llm.has_unfinished():
            start = time.perf_counter()
            result = llm.step()
            if result.kind == "decode":
                decode_time += time.perf_counter() - start
                decoded += result.num_decode_tokens
    return {"decode_tok_s": decoded / decode_time, "execution": llm.execution, "model_info": llm.model_info}


def measure_transformers(model: Path, batch: int, length: int, tokens: int, dtype: str) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts(batch, length, hf.config.vocab_size))
    mask = torch.ones_like(ids)

    def generate(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    generate(1 + tokens)  # warm-up
    elapsed = min(generate(1 + tokens) for _ in range(2)) - min(generate(1) for _ in range(2))
    return {"decode_tok_s": batch * tokens / elapsed,
            "experts_implementation": getattr(hf.config, "_experts_implementation", None)}


def run_worker(args: argparse.Namespace) -> None:
    measure = measure_minichat if args.worker == "minichat" else measure_transformers
    print(json.dumps(measure(Path(args.model), args.batch, args.prompt, args.tokens, args.dtype)))


def in_subprocess(engine: str, model: Path, batch: int, args: argparse.Namespace) -> dict[str, object]:
    cmd = [sys.executable, __file__, str(args.out), "--worker", engine, "--model", str(model), "--batch", str(batch),
           "--prompt", str(args.prompt), "--tokens", str(args.tokens), "--dtype", args.dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} on {model.name} at batch {batch} failed (exit status {done.returncode}; -9: "
                           f"killed, out of memory as a rule):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where the checkpoints and results.json go")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b-3l")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--skip-transformers-dense", action="store_true", help="the dense model on minichat only")
    parser.add_argument("--worker", choices=["minichat", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    moe, dense = write_checkpoints(args.out, args.shape)
    rate = bandwidth()
    floor = {name: bytes_per_token(path, args.dtype) for name, path in (("moe", moe), ("dense", dense))}
    results: dict[str, object] = {"shape": args.shape, "dtype": args.dtype, "prompt": args.prompt,
                                  "tokens": args.tokens, "bandwidth_gb_s": rate / 1e9, "bytes_per_token": floor,
                                  "floor_tok_s": {k: rate / v for k, v in floor.items()}, "runs": []}
    runs: list[dict[str, object]] = []
    for batch in (int(b) for b in args.batches.split(",")):
        for name, path in (("moe", moe), ("dense", dense)):
            engines = ["minichat"] + ([] if name == "dense" and args.skip_transformers_dense else ["transformers"])
            for engine in engines:
                figures = in_subprocess(engine, path, batch, args)
                runs.append({"model": name, "engine": engine, "batch": batch, **figures})
                print(f"{name:5} {engine:12} batch {batch:3}: {figures['decode_tok_s']:8.2f} decode tok/s", flush=True)
                results["runs"] = runs
                (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"memory bandwidth {rate / 1e9:.1f} GB/s; a batch-1 token reads {floor['moe'] / 2**30:.3f} GiB (MoE: its "
          f"routed experts) and {floor['dense'] / 2**30:.3f} GiB (dense): floors {rate / floor['moe']:.2f} and "
          f"{rate / floor['dense']:.2f} tok/s")
    by = {(r["model"], r["engine"], r["batch"]): float(r["decode_tok_s"]) for r in runs}  # type: ignore[arg-type]
    for batch in sorted({int(r["batch"]) for r in runs}):  # type: ignore[call-overload]
        mini, hf = by[("moe", "minichat", batch)], by[("moe", "transformers", batch)]
        print(f"batch {batch}: MoE minichat / transformers {mini / hf:.2f}x; MoE / dense (minichat) "
              f"{mini / by[('dense', 'minichat', batch)]:.2f}x")


if __name__ == "__main__":
    main()
