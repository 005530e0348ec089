"""Engine configuration: small frozen parts, one per concern, and the flat options they are built from.

Every field is one command-line option of the same name (`--max-prefill-tokens`) and one `LLM(...)` keyword; its
`help` is both its comment here and its `--help` line. Each part checks its own fields when it is made and changes
nothing while it checks; `EngineConfig` checks what spans parts. Nothing here imports torch: clients read it too.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"
DTYPES = ("float32", "bfloat16", "float16")
KV_DTYPES = ("auto", *DTYPES, "int8", "fp8")
LINEAR_DTYPES = ("auto", "model", "float32")
ADMISSIONS = ("optimistic", "reserve")
SCHEDULE_POLICIES = ("fcfs", "priority", "lpm")
SPECULATIVE = ("ngram", "draft")
QUANTIZATIONS = {"int8": "Q8_0", "int4": "Q4_1"}
"""`quantization` -> the GGML block format float weights are quantized to at load (engine/model/quantized.py)."""


def model_id(model_path: str) -> str:
    """The name a checkpoint is served under: its directory's name, or a GGUF file's name without `.gguf`."""
    return Path(model_path).name.removesuffix(".gguf")


def knob(default: Any, help: str, *aliases: str) -> Any:
    """A configuration field: its default, what it means (also its `--help` line) and any extra flag spellings."""
    return field(default=default, metadata={"help": help, "aliases": aliases})


def _one_of(part: object, name: str, allowed: typing.Iterable[str], none_ok: bool = False) -> None:
    value = getattr(part, name)
    if not (value is None and none_ok) and value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}{' (or None)' if none_ok else ''}; "
                         f"got {value!r}")


def _at_least(part: object, least: float, *names: str, none: str = "") -> None:
    for name in names:
        value = getattr(part, name)
        if value is not None and not value >= least:
            raise ValueError(f"{name} must be at least {least:g}{none}; got {value}")


@dataclass(frozen=True)
class ExecutionConfig:
    """How a step is computed: on which device, in which precision, through which kernels. The model loader and
    the workers of tensor parallelism read this part alone."""

    device: str = knob("cpu", "cpu, cuda or cuda:N.")
    dtype: str = knob("float32", "float32, bfloat16 or float16: the activations' and the KV pages' type.")
    linear_dtype: str = knob("auto", "GEMM dtype: model, float32, or auto (float32 for bf16/fp16 on CPUs without "
                                     "native support, where it is several times faster).")
    prepack_weights: bool = knob(True, "On CPU, float32 weights prepacked once for oneDNN matmuls (faster than "
                                       "F.linear at every row count measured).")
    cpu_kernels: bool = knob(True, "On CPU, RMSNorm, RoPE, attention and the MLP activation in minichat's C kernels "
                                   "(built with cc; where none builds, the torch paths run).")
    one_call: bool = knob(True, "On CPU, steps of few rows run every layer in one C call (kernels/cpu/decode.c) where "
                                "the model allows it; off: layer by layer (the same products).")
    attention_backend: str = knob("auto", "Attention kernels: torch, cpu, triton, flashinfer, or auto (the best "
                                          "available).")
    cuda_graph: bool = knob(True, "Replay decode steps from CUDA graphs (triton and flashinfer backends on CUDA, "
                                  "one rank).")
    cuda_graph_max_bs: int | None = knob(None, "Largest decode batch replayed from a CUDA graph (default: the "
                                               "request slots, up to 256); bigger ones run eagerly.")
    threads: int | None = knob(None, "CPU compute threads (default: up to the usable cores, as many as measure "
                                     "fastest beside other work; under tensor parallelism each rank its share).")
    background_load: bool = knob(False, "On CPU, load the model on one thread at a lower priority (nice 5), so "
                                        "that engines already serving beside it keep their cores (a catalogue "
                                        "server loads so while other models run).")
    quantization: str | None = knob(None, "Quantize float weights at load: int8 (Q8_0 blocks) or int4 (Q4_1 "
                                          "blocks), which the CPU kernels multiply by as they are; CPU only.")
    dequantize: bool = knob(False, "Expand a GGUF file's quantized weights to --dtype at load (slower; exact vs "
                                   "transformers).")

    def __post_init__(self) -> None:
        _one_of(self, "dtype", DTYPES)
        _one_of(self, "linear_dtype", LINEAR_DTYPES)
        _one_of(self, "quantization", QUANTIZATIONS, none_ok=True)
        _at_least(self, 1, "cuda_graph_max_bs", "threads", none=" (or None: the default)")
        if self.quantization is not None and self.dequantize:
            raise ValueError("quantization and dequantize contradict each other: choose one")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler decides with: how many requests run, how a step's tokens are shared out, who goes first
    (engine/scheduler)."""

    max_running_requests: int | None = knob(None, "Request slots: how many requests may hold KV at once (default: 32 "
                                                  "on CPU, which decodes far fewer tokens a step, 256 on CUDA).")
    max_prefill_tokens: int = knob(2048, "Prefill token budget per step; longer prompts are chunked.")
    mixed_batches: bool = knob(True, "Running requests decode inside a prefill step instead of waiting for it; "
                                     "output is identical.")
    overlap: bool | None = knob(None, "Schedule step N+1 while step N runs (default: on for CUDA, off on CPU, where "
                                      "it measured slower); output is identical.")
    admission: str = knob("optimistic", "optimistic (prompt + expected output; retract when the pool runs dry) or "
                                        "reserve (the whole output budget: nothing is ever retracted).")
    schedule_policy: str = knob("fcfs", "Waiting-queue order: fcfs, priority (SamplingParams.priority, lower first; "
                                        "also picks retraction victims) or lpm (longest cached prefix first).")
    max_wait_steps: int = knob(1000, "A request waiting this many steps is admitted next, whatever the policy.")
    max_consecutive_prefills: int = knob(8, "Without mixed batches: prefill-only steps in a row before running "
                                            "requests decode.")

    def __post_init__(self) -> None:
        _one_of(self, "admission", ADMISSIONS)
        _one_of(self, "schedule_policy", SCHEDULE_POLICIES)
        _at_least(self, 1, "max_running_requests", "max_prefill_tokens", "max_wait_steps",
                  "max_consecutive_prefills")


@dataclass(frozen=True)
class KVConfig:
    """The paged KV pool, the prefix cache over it and the tiers under that (engine/kv)."""

    page_size: int = knob(16, "Tokens per KV page.")
    num_pages: int | None = knob(None, "KV pool size in pages (default: what the request slots can use, within "
                                       "memory).")
    kv_memory_gb: float | None = knob(None, "Memory for the KV pool when --num-pages is not given.")
    max_model_len: int | None = knob(None, "Cap on prompt + output tokens (default: the model's context).")
    prefix_cache: str = knob("radix", "radix (reuse cached prompt prefixes) or naive.")
    kv_host_gib: float | None = knob(None, "Host memory for KV pages the pool evicts (pinned; default: on CUDA as "
                                           "much as the pool, at most a quarter of free memory; on CPU 0, the pool "
                                           "is host memory already).")
    kv_cache_dir: str | None = knob(None, "Directory of the disk KV tier: cached pages written through, loaded back "
                                          "after eviction or a restart (default: $MINICHAT_KV_CACHE_DIR, else kv/ "
                                          "in the user's cache directory).")
    kv_disk_gib: float | None = knob(None, "Cap on the disk KV tier's directory, least recently used pages deleted "
                                           "first (default: 8 GiB, at most half the free space; 0: no disk tier).")
    kv_cache_dtype: str = knob("auto", "What the KV pages hold: auto (the model dtype), float32, bfloat16, float16 "
                                       "(the model dtype named), int8 (a float32 scale per 32 values: 36/128 of "
                                       "float32's bytes; cpu and torch attention backends) or fp8 (not yet).")

    def __post_init__(self) -> None:
        _one_of(self, "prefix_cache", ("radix", "naive"))
        _one_of(self, "kv_cache_dtype", KV_DTYPES)
        if self.kv_cache_dtype == "fp8":
            raise ValueError("kv_cache_dtype 'fp8': minichat's attention kernels do not read fp8 pages yet; int8 "
                             "gives the same memory on every CPU backend")
        _at_least(self, 1, "page_size")
        _at_least(self, 1, "num_pages", none=" (or None to size the pool automatically)")
        _at_least(self, 2, "max_model_len")
        _at_least(self, 0, "kv_host_gib", "kv_disk_gib", none=" (0: no such tier; None: the default)")

    @property
    def tiers_asked(self) -> list[str]:
        """The tier options given (each needs a radix cache on one rank)."""
        return [name for name in ("kv_host_gib", "kv_cache_dir", "kv_disk_gib") if getattr(self, name)]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes tokens for running requests to verify in one step (engine/speculative)."""

    speculative: str | None = knob(None, "Propose tokens to verify in one step: ngram (prompt lookup) or draft "
                                         "(--speculative-model).")
    speculative_model: str | None = knob(None, "A small draft model with the target's tokenizer (implies "
                                               "--speculative draft).")
    num_speculative_tokens: int = knob(4, "Most proposed tokens per request and step (fewer, or none, where they do "
                                          "not pay).")
    speculative_adaptive: bool = knob(True, "Give each request only the drafts that measure faster (off: always as "
                                            "many as proposed).")
    speculative_ngram_max: int = knob(4, "Longest n-gram the ngram proposer looks up in a request's own tokens.")
    speculative_ngram_min: int = knob(2, "Shortest n-gram it falls back to.")

    def __post_init__(self) -> None:
        _one_of(self, "speculative", SPECULATIVE, none_ok=True)
        if (self.method == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative 'draft' needs speculative_model (a checkpoint), and speculative_model "
                             f"goes with speculative 'draft' only; got speculative {self.speculative!r}, "
                             f"speculative_model {self.speculative_model!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16]; got {self.num_speculative_tokens}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max <= 16:
            raise ValueError("speculative_ngram_min and speculative_ngram_max must satisfy 1 <= min <= max <= 16; "
                             f"got {self.speculative_ngram_min} and {self.speculative_ngram_max}")

    @property
    def method(self) -> str | None:
        """The proposer: as asked, else "draft" when a draft model is given, else none."""
        if self.speculative is None and self.speculative_model is not None:
            return "draft"
        return self.speculative


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: how many ranks, and how they spread over machines (engine/distributed)."""

    tensor_parallel_size: int = knob(1, "Split the model over this many ranks (processes; one GPU each on CUDA).",
                                     "--tp")
    nnodes: int = knob(1, "Machines the tensor-parallel ranks span (tensor_parallel_size / nnodes ranks each).")
    node_rank: int = knob(0, "This machine's place among --nnodes: 0 runs the engine, the others only their ranks.")
    dist_init_addr: str | None = knob(None, "HOST:PORT where the nodes meet (node 0 listens on PORT and PORT+1; "
                                            "beyond loopback every node needs the same MINICHAT_TP_TOKEN).")

    def __post_init__(self) -> None:
        _at_least(self, 1, "tensor_parallel_size")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes) and nnodes at least 1; got node_rank "
                             f"{self.node_rank} of nnodes {self.nnodes}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of nnodes "
                             f"{self.nnodes} (each node runs the same number of ranks)")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("nnodes > 1 needs dist_init_addr HOST:PORT: where node 0 meets the others")

    @property
    def per_node(self) -> int:
        """The ranks each node runs."""
        return self.tensor_parallel_size // self.nnodes


PARTS = {"execution": ExecutionConfig, "scheduler": SchedulerConfig, "kv": KVConfig,
         "speculation": SpeculativeConfig, "parallel": ParallelConfig}
"""EngineConfig's parts by attribute name, in the order `--help` shows them."""


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is asked to run, and its parts. Build it from flat options with `EngineConfig.of(...)`."""

    model: str | None = knob(None, "HF checkpoint directory, .gguf file or cached hub id (default: the embedded "
                                   "demo model).")
    seed: int | None = knob(None, "Seed for requests that sample without their own seed (default: a fresh one per "
                                  "engine, so replicas do not sample in lockstep).")
    reasoning_budget: int | None = knob(None, "Tokens a reply's think block may take before the engine closes it, "
                                              "for requests that set no thinking_token_budget (default: unbounded).")
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    speculation: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        _at_least(self, 0, "reasoning_budget", none=" (or None: unbounded)")
        kv, dtype = self.kv.kv_cache_dtype, self.execution.dtype
        if kv in DTYPES and kv != dtype:
            raise ValueError(f"kv_cache_dtype {kv!r} with dtype {dtype!r}: float KV pages are the activations' dtype "
                             f"(auto), or int8")
        if self.kv.tiers_asked and not self.kv_tiers_possible:
            raise ValueError(f"{', '.join(self.kv.tiers_asked)}: the KV tiers go under the radix prefix cache of a "
                             f"single rank; this engine has prefix_cache {self.kv.prefix_cache!r} and "
                             f"tensor_parallel_size {self.parallel.tensor_parallel_size}")

    @classmethod
    def of(cls, **options: Any) -> EngineConfig:
        """The configuration for flat options (the command line's, `LLM(...)`'s): each goes to the part that holds
        it; a name no part holds is refused."""
        unknown = set(options) - set(option_fields())
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        parts = {name: part(**{f.name: options[f.name] for f in dataclasses.fields(part) if f.name in options})
                 for name, part in PARTS.items()}
        return cls(**{name: options[name] for name in TOP_LEVEL if name in options}, **parts)

    def options(self) -> dict[str, Any]:
        """The flat options this configuration was made of (what `of` takes back; what a launcher passes on)."""
        flat = {name: getattr(self, name) for name in TOP_LEVEL}
        for name in PARTS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat

    @property
    def kv_dtype(self) -> str:
        """What the KV pages hold: "int8" or a float dtype's name (auto: the model's)."""
        return self.execution.dtype if self.kv.kv_cache_dtype == "auto" else self.kv.kv_cache_dtype

    @property
    def kv_tiers_possible(self) -> bool:
        """Whether tiers can go under this engine's prefix cache: a radix cache on one rank."""
        return self.kv.prefix_cache == "radix" and self.parallel.tensor_parallel_size == 1

    @property
    def request_slots(self) -> int:
        """The request slots asked for, else what suits the device."""
        if self.scheduler.max_running_requests is not None:
            return self.scheduler.max_running_requests
        return 256 if self.on_cuda else 32

    @property
    def graph_max_bs(self) -> int:
        """The largest decode batch replayed from a CUDA graph."""
        return min(self.execution.cuda_graph_max_bs or 256, self.request_slots)

    @property
    def use_overlap(self) -> bool:
        """Overlap as asked, else on for CUDA (the host never waits for the device) and off on CPU, where
        host work and the model share the same few cores and overlap measured slower served."""
        return self.scheduler.overlap if self.scheduler.overlap is not None else self.on_cuda

    @property
    def on_cuda(self) -> bool:
        return self.execution.device.startswith("cuda")

    @property
    def model_path(self) -> str:
        """The checkpoint to load: the given one, else the embedded demo model."""
        return self.model if self.model else str(DEMO_MODEL_DIR)


TOP_LEVEL = ("model", "seed", "reasoning_budget")
"""EngineConfig's own fields, besides its parts."""


def option_fields() -> dict[str, tuple[dataclasses.Field[Any], Any, str]]:
    """Every engine option by name: its field, its type and the part that holds it ("" for EngineConfig's own)."""
    found: dict[str, tuple[dataclasses.Field[Any], Any, str]] = {}
    for owner, cls in (("", EngineConfig), *PARTS.items()):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in PARTS:
                found[f.name] = (f, hints[f.name], owner)
    return found
