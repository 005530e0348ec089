"""Speculative decoding, measured: single-stream decode tok/s with and without each proposer, side by side.

    python scripts/bench_speculative.py                        # every target, 3 rounds (about 25 min on 2 cores)
    python scripts/bench_speculative.py --targets smollm2-q4_1 --rounds 1

Targets (each loaded once, with each proposer, in process):
- `smollm2-q4_1`: SmolLM2-135M-Instruct as its Q4_1 GGUF (tests/real_model.py), without speculation and with
  prompt lookup (`ngram`); there is no smaller model with its tokenizer for a draft;
- `smollm2-f32`: the same file expanded to float32 (`dequantize`, the transformers-exact path), without, with
  prompt lookup and with the Q4_1 file as its draft model (`draft`);
- `qwen0.5b-int8`: a random Qwen2.5-0.5B-shaped checkpoint (written once, as scripts/bench_llamacpp.py writes
  it, with SmolLM2's tokenizer padded to Qwen's vocabulary) quantized to int8 at load, without and with prompt
  lookup. Its weights are random, so it copies nothing and accepts (almost) no draft: the case where speculation
  must not cost anything. (No draft model: SmolLM2's vocabulary is not the padded one, which a draft must share.)

Workloads, greedy, at most 160 new tokens, one request at a time (decode tok/s: (completion tokens - 1) over
the time after the first token, from the engine's own timings):
- `copy`: chats that repeat their prompt (a paragraph with one word changed; a function with a variable renamed);
- `open`: open-ended chats (a story; an explanation).
And `c32`: all four chats eight times over, 32 at once, output tok/s over the wall time.
In every round each configuration runs once, in turn, so that what the shared machine does weighs on all alike;
the table gives medians over rounds and each proposer's ratio to no speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402
from kernels.cpu.build import cache_dir  # noqa: E402

PARAGRAPH = ("The lighthouse stood at the end of a long stone pier, painted white with a single blue stripe. Every "
             "evening the keeper climbed the one hundred and twelve steps, wiped the salt from the great lens, and "
             "lit the lamp that the fishing boats watched for on their way home.")
CODE = '''def running_total(values):
    total = 0
    result = []
    for value in values:
        total = total + value
        result.append(total)
    return result'''
WORKLOADS = {
    "copy": [f"Repeat this paragraph exactly, word for word, but with 'blue' changed to 'red':\n\n{PARAGRAPH}",
             f"Rewrite this Python function with the variable `total` renamed to `acc`. Output the whole function "
             f"and nothing else.\n\n{CODE}"],
    "open": ["Write a short story about a lighthouse keeper who finds an old map.",
             "Explain to a ten-year-old how a bicycle stays upright."],
}
MAX_TOKENS = 160


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def targets(names: list[str]) -> dict[str, tuple[dict, dict[str, dict]]]:
    """Each target's options and its configurations' extra options (proposers)."""
    from tests.real_model import smollm2_gguf

    smollm2 = str(smollm2_gguf())
    draft = {"speculative_model": smollm2}
    out: dict[str, tuple[dict, dict[str, dict]]] = {}
    for name in names:
        if name == "smollm2-q4_1":
            out[name] = ({"model": smollm2}, {"none": {}, "ngram": {"speculative": "ngram"}})
        elif name == "smollm2-f32":
            out[name] = ({"model": smollm2, "dequantize": True},
                         {"none": {}, "ngram": {"speculative": "ngram"}, "draft": draft})
        elif name == "qwen0.5b-int8":
            from scripts.bench_llamacpp import qwen_f32_gguf

            f32 = qwen_f32_gguf(cache_dir() / "bench-llamacpp")
            out[name] = ({"model": str(f32), "quantization": "int8"}, {"none": {}, "ngram": {"speculative": "ngram"}})
        else:
            raise SystemExit(f"unknown target {name!r}")
    return out


def single_stream(llm: LLM, prompts: list[str]) -> float:
    """Decode tok/s of each prompt alone, pooled: generated tokens after the first over the time after it."""
    tokens = seconds = 0.0
    for text in prompts:
        out = llm.generate([chat(text)], SamplingParams(max_tokens=MAX_TOKENS))[0]
        t = out.timings
        if t.ttft is not None and out.usage.completion_tokens > 1:
            tokens += out.usage.completion_tokens - 1
            seconds += t.total - t.ttft
    return tokens / seconds if seconds else 0.0


def concurrent(llm: LLM) -> float:
    prompts = [chat(p) for ps in WORKLOADS.values() for p in ps] * 8
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return sum(o.usage.completion_tokens for o in outs) / (time.perf_counter() - start)


def acceptance(llm: LLM) -> str:
    c = llm.stats().counters
    return f"{c.spec_accepted_tokens}/{c.spec_draft_tokens}" if c.spec_draft_tokens else "-"


def run(names: list[str], rounds: int) -> dict:
    report: dict = {"rounds": rounds, "load": os.getloadavg(), "cpus": os.cpu_count(), "targets": {}}
    for name, (base, configs) in targets(names).items():
        log(f"{name}: loading {', '.join(configs)}")
        engines = {config: LLM(**base, **extra, kv_disk_gib=0) for config, extra in configs.items()}
        for llm in engines.values():  # warm: kernels built, step costs measured once
            llm.generate([chat("Hello.")], SamplingParams(max_tokens=16))
        results: dict[str, dict[str, list[float]]] = {c: {"copy": [], "open": [], "c32": []} for c in configs}
        for r in range(rounds):
            for config, llm in engines.items():
                for workload, prompts in WORKLOADS.items():
                    results[config][workload].append(single_stream(llm, prompts))
                results[config]["c32"].append(concurrent(llm))
                log(f"{name} round {r + 1} {config}: " + ", ".join(f"{w} {v[-1]:.1f}" for w, v in
                                                                   results[config].items()))
        report["targets"][name] = {c: {w: statistics.median(v) for w, v in res.items()} | {"accepted": acceptance(
            engines[c])} for c, res in results.items()}
        del engines
    report["load_after"] = os.getloadavg()
    return report


def table(report: dict) -> str:
    lines = ["| target | proposer | copy-heavy decode tok/s | open-ended decode tok/s | c=32 output tok/s | "
             "drafts accepted |", "|---|---|---|---|---|---|"]
    for name, configs in report["targets"].items():
        none = configs["none"]
        for config, m in configs.items():
            cells = [f"{m[w]:.1f}" if config == "none" else f"{m[w]:.1f} ({m[w] / none[w]:.2f}x)"
                     for w in ("copy", "open", "c32")]
            lines.append(f"| {name} | {config} | {' | '.join(cells)} | {m['accepted']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="smollm2-q4_1,smollm2-f32,qwen0.5b-int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=cache_dir() / "bench-speculative.json")
    args = parser.parse_args()
    report = run(args.targets.split(","), args.rounds)
    args.json.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"\nload average {report['load'][0]:.2f} before, {report['load_after'][0]:.2f} after, "
          f"{report['cpus']} CPUs; JSON in {args.json}")


if __name__ == "__main__":
    main()
