"""Engine configuration: every knob the scheduler and the KV cache read, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"
DTYPES = ("float32", "bfloat16", "float16")
LINEAR_DTYPES = ("auto", "model", "float32")
ADMISSIONS = ("optimistic", "reserve")
SCHEDULE_POLICIES = ("fcfs", "priority", "lpm")
SPECULATIVE = ("ngram", "draft")
QUANTIZATIONS = {"int8": "Q8_0", "int4": "Q4_1"}
"""`quantization` -> the GGML block format float weights are quantized to at load (engine/model/quantized.py)."""


def model_id(model_path: str) -> str:
    """The name a checkpoint is served under: its directory's name, or a GGUF file's name without `.gguf`."""
    return Path(model_path).name.removesuffix(".gguf")


@dataclass
class EngineConfig:
    """What the engine is asked to run and under which limits.

    `max_running_requests` is the number of request slots (rows of the request table; None: 32 on a
    CPU, which decodes far fewer tokens a step, 256 on a GPU, which a batch of 32 leaves mostly idle);
    `max_prefill_tokens` is the per-step prefill token budget (longer prompts are chunked);
    `num_pages` sizes the paged KV pool (None: derived from `kv_memory_gb` or what the slots can use);
    `prefix_cache` is "radix" (finished requests' full pages are reused by matching prompts) or "naive";
    `linear_dtype` is where the GEMMs run: "model", "float32", or "auto" (float32 for a bf16/fp16 model on
    a CPU without native half-precision GEMM, where it is several times faster; see engine/model/ops.py);
    `prepack_weights` reorders float32 CPU projection weights once at load into oneDNN's layout and runs
    them through oneDNN instead of MKL's `F.linear` (faster at every row count measured; see ops.py).
    `cpu_kernels` runs RMSNorm, RoPE, the MLP activation and (with attention_backend auto or cpu) attention through
    minichat's C kernels on a float32/bfloat16 CPU model, built once with the system's C compiler
    (kernels/cpu); where none builds, the torch paths run instead.
    `tensor_parallel_size` splits the model over that many ranks (processes; one GPU each on CUDA);
    with `nnodes` > 1 they spread over that many machines, `tensor_parallel_size / nnodes` each: node 0
    (`node_rank` 0) runs the engine and meets the others at `dist_init_addr` (HOST:PORT, SGLang's
    spelling), and a node of rank > 0 only runs its ranks (engine/distributed/node.py).
    `overlap` schedules step N+1 while step N runs (the model in a worker thread or on a CUDA stream);
    None picks per device: on for CUDA, off on CPU (see `use_overlap` and docs/architecture.md);
    `mixed_batches` lets running requests decode in the same step as a prefill (see `Scheduler.schedule`);
    off, a step is prefill only or decode only.
    `admission` is how admission counts a request's KV need: "reserve" (prompt plus the
    whole output budget, so nothing is ever retracted) or "optimistic" (prompt plus an expected output,
    and running requests are retracted when the pool runs dry; see engine/scheduler/admission.py).
    `schedule_policy` orders the waiting queue: "fcfs" (arrival), "priority" (SamplingParams.priority,
    then arrival; also picks retraction victims) or "lpm" (longest cached prefix first); under every
    policy a request that has waited `max_wait_steps` steps goes next. With `mixed_batches` off, running
    requests wait at most `max_consecutive_prefills` prefill steps in a row.
    `threads` is how many CPU threads compute a step (torch's and the C kernels' one OpenMP team): None
    is up to the cores this process may use, as many as measure fastest beside whatever else runs
    (engine/threads.py); a number is that many, always. Under tensor parallelism each rank gets its share.
    `quantization` ("int8" or "int4") quantizes float weights at load (a safetensors checkpoint, or a GGUF
    file's float tensors) into GGML's Q8_0 / Q4_1 blocks, which the CPU kernels multiply by as they are; a
    GGUF file's quantized tensors always stay as they are unless `dequantize` expands them to `dtype` (the
    transformers-exact path). See engine/model/quantized.py.
    `cuda_graph` replays decode steps of up to `cuda_graph_max_bs` requests from captured CUDA graphs
    (when the attention backend supports them and there is one rank; see engine/cuda_graph.py; None:
    every decode batch the request slots allow, up to 256).
    `speculative` proposes tokens for running requests to verify in one step (engine/speculative):
    "ngram" looks the last `speculative_ngram_max` .. `speculative_ngram_min` tokens up in the request's
    own prompt and output, "draft" runs `speculative_model` (a small model with the same tokenizer; giving
    it implies "draft"). At most `num_speculative_tokens` per request and step; how many a request gets,
    down to none, is decided each step from its acceptance and the measured cost of a longer step
    (`speculative_adaptive`; off, every request gets as many as the proposer has, up to that many).
    `kv_host_gib`, `kv_cache_dir` and `kv_disk_gib` are the tiers under the radix prefix cache (engine/kv/tiers.py):
    pages the pool evicts move to host memory (`kv_host_gib`, pinned on CUDA; None: as much as the pool, at most
    a quarter of the free memory, on CUDA, and 0 on a CPU, whose pool is host memory already), and every cached
    page is written through to files in `kv_cache_dir` (None: $MINICHAT_KV_CACHE_DIR, else `kv` in the user's
    cache directory), at most `kv_disk_gib` of them (None: 8 GiB, at most half the free space there; 0: no disk
    tier), so a prefix the pool no longer has, also after a restart, is loaded back rather than computed. They
    need the radix cache and one rank (tensor parallelism does not run them yet); asking for them otherwise is
    refused.
    `reasoning_budget` bounds the think block of requests that split one off (SamplingParams.reasoning)
    and give no `thinking_token_budget`: after that many tokens inside it the engine closes it (llama.cpp's
    --reasoning-budget; None: unbounded; engine/reasoning.py).
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_gb: float | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int = 2048
    max_model_len: int | None = None
    seed: int | None = None  # the seeds of requests that bring none: from this, else from the OS
    attention_backend: str = "auto"
    prefix_cache: str = "radix"
    linear_dtype: str = "auto"
    prepack_weights: bool = True
    cpu_kernels: bool = True
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    overlap: bool | None = None
    mixed_batches: bool = True
    cuda_graph: bool = True
    cuda_graph_max_bs: int | None = None
    threads: int | None = None
    admission: str = "optimistic"
    schedule_policy: str = "fcfs"
    max_wait_steps: int = 1000
    max_consecutive_prefills: int = 8
    quantization: str | None = None
    dequantize: bool = False
    speculative: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    speculative_adaptive: bool = True
    speculative_ngram_max: int = 4
    speculative_ngram_min: int = 2
    reasoning_budget: int | None = None
    kv_host_gib: float | None = None
    kv_cache_dir: str | None = None
    kv_disk_gib: float | None = None

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_counts()
        self._check_nodes()
        self._check_speculation()
        self._check_tiers()
        if self.quantization is not None and self.dequantize:
            raise ValueError("quantization and dequantize contradict each other: choose one")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2; got {self.max_model_len}")

    def _check_choices(self) -> None:
        """The fields that name one of a few choices."""
        for name, allowed in (("dtype", DTYPES), ("linear_dtype", LINEAR_DTYPES), ("admission", ADMISSIONS),
                              ("schedule_policy", SCHEDULE_POLICIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None); "
                             f"got {self.quantization!r}")

    def _check_counts(self) -> None:
        """The sizes and limits, each at least 1 where given."""
        for name in ("page_size", "max_running_requests", "max_prefill_tokens", "tensor_parallel_size",
                     "cuda_graph_max_bs", "max_wait_steps", "max_consecutive_prefills"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1; got {getattr(self, name)}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be at least 1 (or None to size the pool automatically); "
                             f"got {self.num_pages}")
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            raise ValueError(f"reasoning_budget must be at least 0 (or None: unbounded); got {self.reasoning_budget}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1 (or None: as many as suit the machine); got {self.threads}")

    def _check_nodes(self) -> None:
        """How the tensor-parallel ranks spread over machines."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes) and nnodes at least 1; got node_rank "
                             f"{self.node_rank} of nnodes {self.nnodes}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of nnodes "
                             f"{self.nnodes} (each node runs the same number of ranks)")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("nnodes > 1 needs dist_init_addr HOST:PORT: where node 0 meets the others")

    def _check_speculation(self) -> None:
        """The proposer and its sizes (a draft model alone means "draft")."""
        if self.speculative_model is not None and self.speculative is None:
            self.speculative = "draft"
        if self.speculative is not None and self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE)} (or None); got {self.speculative!r}")
        if (self.speculative == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative 'draft' needs speculative_model (a checkpoint), and speculative_model "
                             f"goes with speculative 'draft' only; got speculative {self.speculative!r}, "
                             f"speculative_model {self.speculative_model!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16]; got {self.num_speculative_tokens}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max <= 16:
            raise ValueError("speculative_ngram_min and speculative_ngram_max must satisfy 1 <= min <= max <= 16; "
                             f"got {self.speculative_ngram_min} and {self.speculative_ngram_max}")

    def _check_tiers(self) -> None:
        """The KV tiers' sizes, and that they go under a radix cache on one rank."""
        for name in ("kv_host_gib", "kv_disk_gib"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be at least 0 (0: no such tier; None: the default); "
                                 f"got {getattr(self, name)}")
        asked = [name for name in ("kv_host_gib", "kv_cache_dir", "kv_disk_gib") if getattr(self, name)]
        if asked and not self.kv_tiers_possible:
            raise ValueError(f"{', '.join(asked)}: the KV tiers go under the radix prefix cache of a single rank; "
                             f"this engine has prefix_cache {self.prefix_cache!r} and tensor_parallel_size "
                             f"{self.tensor_parallel_size}")

    @property
    def kv_tiers_possible(self) -> bool:
        """Whether tiers can go under this engine's prefix cache: a radix cache on one rank."""
        return self.prefix_cache == "radix" and self.tensor_parallel_size == 1

    @property
    def request_slots(self) -> int:
        """The request slots asked for, else what suits the device."""
        if self.max_running_requests is not None:
            return self.max_running_requests
        return 256 if self.device.startswith("cuda") else 32

    @property
    def graph_max_bs(self) -> int:
        """The largest decode batch replayed from a CUDA graph."""
        return min(self.cuda_graph_max_bs or 256, self.request_slots)

    @property
    def use_overlap(self) -> bool:
        """Overlap as asked, else on for CUDA (the host never waits for the device) and off on CPU, where
        host work and the model share the same few cores and overlap measured slower served."""
        return self.overlap if self.overlap is not None else self.device.startswith("cuda")

    @property
    def model_path(self) -> str:
        """The checkpoint to load: the given one, else the embedded demo model."""
        return self.model if self.model else str(DEMO_MODEL_DIR)
