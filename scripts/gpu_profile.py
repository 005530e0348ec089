"""Where one engine step's time goes: kernels, kernel families, host gaps and host work, under torch.profiler.

    python scripts/gpu_profile.py /tmp/qwen05b --device cuda --dtype bfloat16            # batch 1, 32, 128
    python scripts/gpu_profile.py engine/demo_model --batches 1,4 --prompt-len 16 --steps 3 --json out.json

`minichat bench` says how fast the engine serves; this says why, so that work goes where the time is:
into kernels (and which family of them), into launching them, or into the host's own work around the
forward. It builds one in-process `LLM` and drives its scheduler by hand (`schedule()`, the runner's
`run()`, `process()`), so every step is exactly the batch asked for and each phase is timed on its own.

For each batch size B, three rounds of B fresh requests (random prompt ids, `ignore_eos`, an output
budget the round never reaches), each: the prefill step that takes all B prompts, then decode steps
with exactly B running. Round 1 warms up (Triton compiles, cuBLAS picks kernels, graphs replay once);
round 2 is timed without the profiler (wall and host phases: the profiler itself slows the host).
Then every batch size's round 3 runs in one torch.profiler session (kernels, families, device busy
time): one session, started after the CUDA graphs were captured, because CUPTI set up before a capture
has been reported to record no kernels of its replays at all. Steps run in sequence, never
overlapped, so that a step's device work and host work can be told apart: the host gap printed is the
most that overlapping (on by default on CUDA) could hide.

What is counted per step:
- kernels: on CUDA the kernels the device ran, memcpy/memset counted apart (CUPTI reports the kernels
  inside CUDA graph replays when it was not set up before the capture; a row where it reports none
  says n/a rather than 0). On a CPU the outermost aten ops and minichat's C kernels (RMSNorm, RoPE,
  SiLU*up, paged attention, the block-format products and the one-call layers), which the script marks
  with `record_function` because ctypes calls are invisible to the profiler otherwise.
- families: each kernel's (CUDA) or outermost op's (CPU) time, grouped by its name into layers (the
  one-call layers, a block-format model's or a small float32 model's: everything but the embedding, final
  norm and head), gemm,
  attention, norm, rope, activation, sampling, elementwise, copy/index (K/V cache writes included) and
  other. Names are all there is inside a CUDA graph, so generic elementwise kernels land in
  "elementwise" whatever they compute (residual adds; on CUDA the multiply after SiLU and RoPE's
  multiplies and adds, whose roll alone counts as rope); a torch attention backend's matmuls in "gemm".
- busy: CUDA, the union of the step's device intervals; CPU, the time inside those outermost ops.
- host gap: the unprofiled step's wall time minus busy (at least 0: on a CPU the profiler's own cost
  per op can make busy exceed it; the JSON also has the profiled steps' own gap): on CUDA the time
  the device idles while the host schedules, launches and processes; on a CPU the Python outside ops.
- host phases (unprofiled): schedule (`ForwardBatch.schedule_time`), forward (the runner's `forward`:
  on CUDA only launching it), sample (the rest of `run`: sampling and the token-table write, launched
  on CUDA), wait (for the device, CUDA only), process (`Scheduler.process`).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams
from engine.batch import ForwardBatch
from engine.config import DEMO_MODEL_DIR
from engine.pages import pages_for
from kernels.cpu import CpuKernels
from kernels.cpu.decode import FusedLayers

STEP_RANGE = "minichat.step/"  # + a label: one engine step, schedule to process; splits a profile into steps
UNCOUNTED = "other"  # the label of steps that are run but not reported (the rest of a chunked prefill, warm-up)
FORWARD_RANGE = "minichat.forward"  # the runner's forward (for reading a trace; timed with perf_counter)
CPU_KERNEL_PREFIX = "cpu_kernel::"  # minichat's C kernels, which the profiler cannot see by itself
CPU_KERNEL_METHODS = ("rms_norm", "rope_", "silu_mul", "paged_attention", "q_linear", "dequantize")

# Checked in order, on the lower-cased name; the first that matches names the family. Sampling comes
# before gemm and copy (an argmax is a reduction kernel), attention before gemm (FlashInfer and
# CUTLASS attention kernels mention "gemm"-like tiles), norm/rope/activation before elementwise.
FAMILY_PATTERNS: tuple[tuple[str, str], ...] = (
    ("layers", r"fused_layers"),  # a block-format model's every layer in one C call (kernels/cpu/decode.c)
    # greedy tokens are max(dim) (engine/sampling.greedy_tokens): aten::max on a CPU, a MaxOps reduction on CUDA
    ("sampling", r"argmax|argmin|aten::max$|maxops|multinomial|topk|top_k|top_p|sort|cumsum|exponential|sampl|"
                 r"penalt"),
    ("attention", r"attention|attn|flash|fmha|_decode_(grouped_)?stage|_extend_kernel|batchdecode|batchprefill|"
                  r"scaled_dot_product|sdpa|softmax"),
    ("norm", r"rms_?norm|layer_?norm|rsqrt|meanops|pow_tensor_scalar"),
    ("rope", r"rope|rotary|\broll"),  # aten::roll, roll_cuda_kernel; not unrolled_elementwise_kernel (copies)
    ("activation", r"silu|gelu|swiglu|act_and_mul"),
    ("gemm", r"gemm|gemv|cutlass|cublas|nvjet|xmma|splitk|_linear_pointwise|q_linear|aten::(addmm|mm|bmm|baddbmm|"
             r"matmul|linear)$"),
    ("copy/index", r"copy|index|gather|scatter|embedding|memcpy|memset|aten::cat$|catarray|fill|aten::to$|clone|"
                   r"contiguous|arange|_store_kv|aten::tensor$|_local_scalar|aten::item$"),
    ("elementwise", r"elementwise|functor|aten::(add|add_|mul|mul_|sub|div|neg|where|masked_fill)$"),
)
FAMILIES = (*[name for name, _ in FAMILY_PATTERNS], "other")
_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in FAMILY_PATTERNS)


def family(name: str) -> str:
    """The family a kernel or op belongs to, by its name (see FAMILY_PATTERNS)."""
    lowered = name.lower()
    return next((fam for fam, pattern in _COMPILED if pattern.search(lowered)), "other")


def short_name(name: str, width: int = 88) -> str:
    """A kernel name short enough for a table line (CUDA template names run to kilobytes)."""
    name = " ".join(name.split()).removeprefix("void ")
    return name if len(name) <= width else name[: width - 3] + "..."


# -- driving the engine ---------------------------------------------------------------------------------


@dataclass
class StepTiming:
    """Host seconds of one step's phases (see the module docstring)."""

    kind: str
    requests: int
    tokens: int
    wall: float
    schedule: float
    forward: float
    sample: float
    wait: float
    process: float


class ForwardTimer:
    """Stands in for `runner.forward` (an instance attribute shadows the method) to time it and mark it
    in the profile, without touching the engine's code."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor]) -> None:
        self.forward = forward
        self.seconds = 0.0

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        start = time.perf_counter()
        with record_function(FORWARD_RANGE):
            logits = self.forward(batch)
        self.seconds += time.perf_counter() - start
        return logits


@contextmanager
def visible_cpu_kernels(llm: LLM) -> Iterator[int]:
    """Wrap minichat's C kernels (ctypes calls, which torch.profiler does not record) in
    `record_function` ranges for the duration, so that they count as ops; yields how many kernel
    objects were wrapped (0 when the C kernels are off or the device is not a CPU)."""
    candidates = (getattr(llm.model, "kernels", None), getattr(llm.runner.backend, "kernels", None))
    objects = {id(k): k for k in candidates if isinstance(k, CpuKernels)}
    wrapped: list[tuple[object, str]] = []

    def marked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(CPU_KERNEL_PREFIX + name):
                return fn(*args, **kwargs)
        return call

    one_call = FusedLayers.__call__
    try:
        for kernels in objects.values():
            for name in CPU_KERNEL_METHODS:
                if hasattr(kernels, name) and name not in vars(kernels):
                    setattr(kernels, name, marked(name, getattr(kernels, name)))
                    wrapped.append((kernels, name))
        FusedLayers.__call__ = marked("fused_layers", one_call)  # type: ignore[method-assign]
        yield len(objects)
    finally:
        FusedLayers.__call__ = one_call  # type: ignore[method-assign]
        for kernels, name in wrapped:
            delattr(kernels, name)


class Driver:
    """Steps the LLM's scheduler by hand, one batch at a time, timing each phase."""

    def __init__(self, llm: LLM, prompt_len: int, output_budget: int) -> None:
        self.llm = llm
        self.prompt_len = prompt_len
        self.params = SamplingParams(max_tokens=output_budget, ignore_eos=True, temperature=0.0)
        self.timer = ForwardTimer(llm.runner.forward)
        llm.runner.forward = self.timer  # type: ignore[method-assign]
        self.cuda = llm.device.type == "cuda"
        self._rounds = 0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.llm.device)

    def add_requests(self, batch: int) -> list[str]:
        """B fresh requests; each round draws new prompts, so no prefix is served from the cache."""
        self._rounds += 1
        g = torch.Generator().manual_seed(self._rounds)
        prompts = torch.randint(0, self.llm.model.spec.vocab_size, (batch, self.prompt_len), generator=g).tolist()
        return [self.llm.add_request(p, self.params) for p in prompts]

    def step(self, label: str = UNCOUNTED) -> StepTiming:
        """One step in sequence: schedule, run, wait for the device, process, in a profiler range
        named by `label`."""
        sched, runner = self.llm.scheduler, self.llm.runner
        with record_function(STEP_RANGE + label):
            start = time.perf_counter()
            batch = sched.schedule()
            if batch is None:
                raise RuntimeError("the scheduler had nothing to run with requests live")
            launched = time.perf_counter()
            self.timer.seconds = 0.0
            output = runner.run(batch)
            ran = time.perf_counter()
            output.tokens()  # waits for the device on CUDA; process() reads the tokens again (a host list)
            waited = time.perf_counter()
            result = sched.process(batch, output)
            end = time.perf_counter()
        if result.finished:
            raise RuntimeError(f"requests ended during profiling ({result.finished}): raise the output budget")
        return StepTiming(kind=batch.kind, requests=len(batch.reqs), tokens=batch.num_tokens, wall=end - start,
                          schedule=batch.schedule_time, forward=self.timer.seconds,
                          sample=max(0.0, ran - launched - self.timer.seconds), wait=waited - ran,
                          process=end - waited)

    def finish(self, rids: Iterable[str]) -> None:
        """Abort the round's requests and let the engine settle (their Finals pop out of the LLM)."""
        for rid in rids:
            self.llm.abort(rid)
        while self.llm.has_unfinished():
            self.llm.step()
        self.llm.check_integrity()


@dataclass
class Round:
    """One round of a batch size: its prefill step and its steady decode steps."""

    prefill: StepTiming
    decode: list[StepTiming]


def run_round(driver: Driver, batch: int, decode_steps: int, warm_steps: int) -> Round:
    """Prefill B prompts (the first step), step until exactly B decode, take `warm_steps` decode
    steps, then `decode_steps` measured ones; the measured steps are labelled `b{B}/prefill` and
    `b{B}/decode` for the profile."""
    rids = driver.add_requests(batch)
    prefill = driver.step(f"b{batch}/prefill")
    if prefill.kind != "prefill":
        raise RuntimeError(f"the round's first step was {prefill.kind}, not a prefill (a previous round left work)")
    for _ in range(4 * batch + 8):  # the rest of a chunked prefill, if the budget split it
        if _steady(driver, batch):
            break
        driver.step()
    else:
        raise RuntimeError(f"{batch} requests never decoded together (KV pool or request slots too small?)")
    for _ in range(warm_steps):
        driver.step()
    decode = [driver.step(f"b{batch}/decode") for _ in range(decode_steps)]
    bad = [(s.kind, s.requests) for s in decode if s.kind != "decode" or s.requests != batch]
    if bad:
        raise RuntimeError(f"expected decode steps of exactly {batch} requests, got {bad}")
    driver.finish(rids)
    return Round(prefill, decode)


def _steady(driver: Driver, batch: int) -> bool:
    """Whether the next step decodes all B requests: nothing waiting or prefilling, B running."""
    snap = driver.llm.stats()
    return not snap.waiting and len(snap.running) == batch and all(r.state == "running" for r in snap.running)


# -- reading a profile ----------------------------------------------------------------------------------


@dataclass
class StepProfile:
    """What one profiled step ran (see the module docstring for the definitions)."""

    kernels: int = 0  # CUDA: device kernels; CPU: outermost ops (C kernels included)
    copies: int = 0  # CUDA memcpy / memset
    host_ops: int = 0  # outermost host ops (on CUDA the ones that launch; few under a graph replay)
    busy_us: float = 0.0
    family_us: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FAMILIES, 0.0))
    names: Counter[str] = field(default_factory=Counter)  # kernel/op -> count
    name_us: Counter[str] = field(default_factory=Counter)  # kernel/op -> microseconds


def _activity(e: Any) -> str:
    """kineto's activity type of a profiler event ("cpu_op", "user_annotation", "kernel", "gpu_memcpy",
    "cuda_runtime", ...), from its name where this torch's FunctionEvent does not carry it."""
    kind = getattr(e, "activity_type", None)
    if kind:
        return str(kind)
    name = e.name
    if e.device_type != DeviceType.CPU:
        if name.startswith(("Memcpy", "Memset")):
            return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset"
        return "gpu_user_annotation" if name.startswith(("minichat.", CPU_KERNEL_PREFIX)) else "kernel"
    if getattr(e, "is_user_annotation", False) or name.startswith(("minichat.", CPU_KERNEL_PREFIX)):
        return "user_annotation"
    return "cuda_runtime" if re.match(r"cu(da)?[A-Z]", name) else "cpu_op"  # cudaLaunchKernel, cuLaunchKernel


def _is_host_op(e: Any) -> bool:
    """An op that does work: an aten (or other registered) op, or one of the marked C kernels."""
    kind = _activity(e)
    return (kind == "cpu_op" and not e.is_async) or (kind == "user_annotation" and e.name.startswith(CPU_KERNEL_PREFIX))


def _outermost(e: Any) -> bool:
    parent = e.cpu_parent
    while parent is not None:
        if _is_host_op(parent):
            return False
        parent = parent.cpu_parent
    return True


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def analyse(prof: Any, device: str) -> dict[str, list[StepProfile]]:
    """Split a profile into its labelled steps and count each one's kernels, ops and families; the
    steps of each label in order.

    An event belongs to the step whose range it starts in. Every step waits for its device work
    before it ends, and launches nothing before it has scheduled on the host, so a device event
    starts well inside its own step's range; this needs no link from kernel to launching op, which the
    kernels inside a CUDA graph replay do not have."""
    events = list(prof.events())
    ranges = sorted((e for e in events if e.name.startswith(STEP_RANGE) and e.device_type == DeviceType.CPU),
                    key=lambda e: e.time_range.start)
    starts = [r.time_range.start for r in ranges]
    steps = [StepProfile() for _ in ranges]
    intervals: list[list[tuple[float, float]]] = [[] for _ in ranges]

    def owner(t: float) -> int | None:
        i = bisect.bisect_right(starts, t) - 1
        return i if 0 <= i < len(steps) and t <= ranges[i].time_range.end else None

    def count(step: StepProfile, name: str, us: float) -> None:
        step.family_us[family(name)] += us
        step.names[name] += 1
        step.name_us[name] += us

    cuda = device == "cuda"
    for e in events:
        i = owner(e.time_range.start)
        if i is None:
            continue
        step = steps[i]
        us = e.time_range.end - e.time_range.start
        kind = _activity(e)
        if e.device_type != DeviceType.CPU:
            if not cuda or kind not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue  # annotations mirrored on the device, synchronisation records, overhead
            if kind == "kernel":
                step.kernels += 1
            else:
                step.copies += 1
            count(step, e.name, us)
            intervals[i].append((e.time_range.start, e.time_range.end))
        elif _is_host_op(e) and _outermost(e):
            step.host_ops += 1
            if not cuda:
                step.kernels += 1
                step.busy_us += us
                count(step, e.name, us)
    if cuda:
        for step, spans in zip(steps, intervals, strict=True):
            step.busy_us = _union_us(spans)
    labelled: dict[str, list[StepProfile]] = {}
    for r, step in zip(ranges, steps, strict=True):
        label = r.name.removeprefix(STEP_RANGE)
        if label != UNCOUNTED:
            labelled.setdefault(label, []).append(step)
    return labelled


# -- the report -----------------------------------------------------------------------------------------


@dataclass
class Row:
    """One (batch size, step kind) line of the report; times in ms per step, counts per step."""

    batch: int
    kind: str
    requests: int
    tokens: int
    steps: int
    cuda_graph: bool
    wall_ms: float  # median, unprofiled
    wall_profiled_ms: float
    kernels: float | None
    memcpy: float | None  # memcpy and memset, apart from the kernels
    host_ops: float
    busy_ms: float | None
    host_gap_ms: float | None
    host_gap_profiled_ms: float | None  # the profiled steps' own wall minus busy (the profiler slows the host)
    schedule_ms: float
    forward_ms: float
    sample_ms: float
    wait_ms: float
    process_ms: float
    family_ms: dict[str, float | None]
    top: list[dict[str, Any]]


def _ms(seconds: Iterable[float]) -> float:
    return statistics.median(seconds) * 1e3


def make_row(batch: int, kind: str, timed: list[StepTiming], profiled: list[StepTiming],
             profiles: list[StepProfile], graphed: bool, device: str, top: int) -> Row:
    n = len(profiles)
    if n != len(profiled):
        raise RuntimeError(f"the profile holds {n} steps where {len(profiled)} ran")
    kernels = sum(p.kernels for p in profiles) / n
    # Kernels that the profiler cannot see (CUPTI without graph-node tracing) make an empty step:
    # its kernel figures are then unknown, not zero.
    seen = kernels > 0
    busy = sum(p.busy_us for p in profiles) / n / 1e3 if seen else None
    wall = _ms(s.wall for s in timed)
    names: Counter[str] = Counter()
    name_us: Counter[str] = Counter()
    for p in profiles:
        names.update(p.names)
        name_us.update(p.name_us)
    return Row(
        batch=batch, kind=kind, requests=timed[0].requests, tokens=timed[0].tokens, steps=n, cuda_graph=graphed,
        wall_ms=wall, wall_profiled_ms=_ms(s.wall for s in profiled), kernels=kernels if seen else None,
        memcpy=sum(p.copies for p in profiles) / n if device == "cuda" and seen else None,
        host_ops=sum(p.host_ops for p in profiles) / n,
        busy_ms=busy, host_gap_ms=max(0.0, wall - busy) if busy is not None else None,
        host_gap_profiled_ms=max(0.0, _ms(s.wall for s in profiled) - busy) if busy is not None else None,
        schedule_ms=_ms(s.schedule for s in timed), forward_ms=_ms(s.forward for s in timed),
        sample_ms=_ms(s.sample for s in timed), wait_ms=_ms(s.wait for s in timed),
        process_ms=_ms(s.process for s in timed),
        family_ms={f: (sum(p.family_us[f] for p in profiles) / n / 1e3 if seen else None) for f in FAMILIES},
        top=[{"name": short_name(name, 200), "family": family(name), "per_step": names[name] / n,
              "ms_per_step": us / n / 1e3} for name, us in name_us.most_common(top)])


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def render(report: dict[str, Any]) -> str:
    """The report as plain-text tables: one line per (batch, kind), then families, then top kernels."""
    rows = [Row(**r) for r in report["rows"]]
    unit = report["kernel_unit"]
    out = [f"# {report['model']} {report['dtype']} on {report['device_name']} (torch {report['torch']}), "
           f"prompt {report['prompt_len']} tokens; " + ", ".join(f"{k} {v}" for k, v in report["execution"].items()),
           f"# kernels = {unit} per step; host phases and wall without the profiler (medians), kernels and busy "
           f"under it (means)"]
    head = ("batch", "kind", "tokens", "steps", "graph", "wall ms", "kernels", "memcpy", "host ops", "busy ms",
            "gap ms", "sched ms", "fwd ms", "sample ms", "wait ms", "process ms")
    table = [head]
    for r in rows:
        table.append((str(r.batch), r.kind, str(r.tokens), str(r.steps), "yes" if r.cuda_graph else "no",
                      _fmt(r.wall_ms), _fmt(r.kernels, 1), _fmt(r.memcpy, 1), f"{r.host_ops:.1f}", _fmt(r.busy_ms),
                      _fmt(r.host_gap_ms), _fmt(r.schedule_ms, 3), _fmt(r.forward_ms, 3), _fmt(r.sample_ms, 3),
                      _fmt(r.wait_ms, 3), _fmt(r.process_ms, 3)))
    out += _columns(table)
    out += ["", "# time per kernel family, ms per step (share of the step's kernel time)"]
    table = [("family", *[f"b{r.batch} {r.kind}" for r in rows])]
    for fam in FAMILIES:
        cells = []
        for r in rows:
            ms = r.family_ms[fam]
            total = sum(v for v in r.family_ms.values() if v is not None)
            cells.append("n/a" if ms is None else f"{ms:.3f} ({100 * ms / total:.0f}%)" if total else f"{ms:.3f}")
        table.append((fam, *cells))
    out += _columns(table)
    for r in rows:
        out += ["", f"# top kernels, batch {r.batch} {r.kind}: per step count, ms, family"]
        out += [f"  {t['per_step']:6.1f} {t['ms_per_step']:9.3f}  {t['family']:<12} {short_name(t['name'])}"
                for t in r.top] or ["  none seen"]
    if report["notes"]:
        out += ["", *[f"note: {n}" for n in report["notes"]]]
    return "\n".join(out)


def _columns(table: list[tuple[str, ...]]) -> list[str]:
    """Aligned columns: the first left-aligned (labels), the rest right-aligned (numbers)."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for row in table:
        cells = [cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells))
    return lines


# -- main -----------------------------------------------------------------------------------------------


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"batch sizes are integers separated by commas; got {text!r}") from e
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be at least 1; got {text!r}")
    return batches


def build_llm(args: argparse.Namespace, output_budget: int) -> LLM:
    """One engine for every batch size: slots for the largest, a prefill budget that takes all its
    prompts in one step (unless --max-prefill-tokens says less), and a KV pool that holds every
    request's whole budget, so nothing is retracted and admission never waits."""
    largest = max(args.batches)
    length = args.prompt_len + output_budget
    options: dict[str, Any] = {"attention_backend": args.attention_backend, "cuda_graph": args.cuda_graph}
    if args.threads:
        options["threads"] = args.threads
    if args.dequantize:
        options["dequantize"] = True
    llm = LLM(args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
              num_pages=largest * (pages_for(length, args.page_size) + 1), max_running_requests=largest,
              max_prefill_tokens=args.max_prefill_tokens or max(2048, largest * args.prompt_len),
              max_model_len=length + args.page_size, overlap=False,
              kv_disk_gib=0, one_call=args.one_call, **options)  # no disk tier: a rerun's prompts would be loaded
    return llm


def profile_batches(args: argparse.Namespace) -> dict[str, Any]:
    output_budget = args.warmup_steps + args.steps + 4  # never reached: every round aborts its requests
    llm = build_llm(args, output_budget)
    context = llm.max_seq_len
    if args.prompt_len + output_budget > context:
        raise SystemExit(f"prompt {args.prompt_len} + {output_budget} output tokens exceed the context "
                         f"({context}); lower --prompt-len or --steps")
    device = llm.device.type
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    driver = Driver(llm, args.prompt_len, output_budget)
    notes: list[str] = []
    rows: list[Row] = []
    graphs = llm.runner.graphs
    timed: dict[int, Round] = {}
    try:
        with visible_cpu_kernels(llm) as marked:
            for batch in args.batches:
                run_round(driver, batch, args.steps, args.warmup_steps)  # warm-up
                timed[batch] = run_round(driver, batch, args.steps, args.warmup_steps)
                print(f"batch {batch}: prefill {timed[batch].prefill.wall * 1e3:.2f} ms, decode "
                      f"{statistics.median(s.wall for s in timed[batch].decode) * 1e3:.2f} ms/step (no profiler)",
                      file=sys.stderr, flush=True)
            driver.sync()
            with profile(activities=activities) as prof:
                profiled = {batch: run_round(driver, batch, args.steps, args.warmup_steps) for batch in args.batches}
                driver.sync()
    finally:
        llm.close()
    print("profiled; reading the profile", file=sys.stderr, flush=True)
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    steps = analyse(prof, device)
    for batch in args.batches:
        graphed = graphs is not None and graphs.bucket(batch) is not None
        for kind in ("prefill", "decode"):
            t_round, p_round = timed[batch], profiled[batch]
            t_steps = [t_round.prefill] if kind == "prefill" else t_round.decode
            p_steps = [p_round.prefill] if kind == "prefill" else p_round.decode
            rows.append(make_row(batch, kind, t_steps, p_steps, steps.get(f"b{batch}/{kind}", []),
                                 graphed and kind == "decode", device, args.top))
    if device == "cuda":
        unit = "CUDA kernels the device ran (memcpy/memset apart)"
        blind = [r for r in rows if r.kernels is None]
        if blind:
            notes.append("the profiler reported no kernels for " + ", ".join(f"b{r.batch} {r.kind}" for r in blind)
                         + (" (CUDA graph replays: this CUPTI does not trace graph kernels)"
                            if all(r.cuda_graph for r in blind) else "") + "; their kernel figures are n/a")
        if any(r.cuda_graph for r in rows):
            notes.append("graphed decode steps: host ops are the few around the replay; the kernels inside it are "
                         "counted from the device's activity, by name only (no op launches them)")
    else:
        unit = "outermost aten ops" + (" and minichat's C kernels" if marked else "") + " (CPU: no device kernels)"
        notes.append("memcpy is n/a on a CPU (no device copies); busy = time inside ops, gap = the step's Python "
                     "outside them; wait is ~0 (the CPU step is done when run returns)")
    return {"model": str(args.model), "dtype": args.dtype, "device": device,
            "device_name": torch.cuda.get_device_name(llm.device) if device == "cuda" else "cpu",
            "torch": torch.__version__, "prompt_len": args.prompt_len, "batches": args.batches,
            "decode_steps": args.steps, "execution": llm.execution, "kernel_unit": unit, "families": list(FAMILIES),
            "notes": notes, "rows": [asdict(r) for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(DEMO_MODEL_DIR),
                        help="checkpoint directory (default: the demo model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--batches", type=parse_batches, default=[1, 32, 128], metavar="B[,B...]",
                        help="decode batch sizes (default 1,32,128)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=8, help="decode steps measured per batch size")
    parser.add_argument("--warmup-steps", type=int, default=2, help="decode steps before the measured ones")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-prefill-tokens", type=int,
                        help="per-step token budget (default: all of the largest batch's prompts in one step)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, help="CPU compute threads (default: the engine's choice)")
    parser.add_argument("--dequantize", action="store_true", help="a GGUF file's blocks expanded to --dtype")
    parser.add_argument("--one-call", action=argparse.BooleanOptionalAction, default=True,
                        help="the layers in one C call where they can: a block-format model's, or a small float32 "
                             "model's kept rows (off: layer by layer)")
    parser.add_argument("--top", type=int, default=6, help="kernels listed per row")
    parser.add_argument("--json", type=Path, help="also write the report here as JSON ('-': stdout, no table)")
    parser.add_argument("--trace", type=Path, help="also write the profile here as a Chrome trace (JSON)")
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.prompt_len < 1 or args.steps < 1 or args.warmup_steps < 0:
        parser.error("--prompt-len and --steps must be at least 1, --warmup-steps at least 0")
    report = profile_batches(args)
    if str(args.json) == "-":
        print(json.dumps(report, indent=2))
        return
    print(render(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
