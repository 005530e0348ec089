"""LLM: the in-process engine (model + KV memory + scheduler) and its offline and step-by-step API."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import secrets
import shutil
import threading
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from tqdm import tqdm

from engine.config import EngineConfig, model_id
from engine.cuda_graph import DecodeGraphs
from engine.distributed import TensorParallel
from engine.distributed.workers import WorkerPool, launch
from engine.generation_defaults import generation_defaults
from engine.kv import KVTiers, make_cache_manager
from engine.kv.disk import default_dir
from engine.kv.fingerprint import WEIGHTS_MEMO, fingerprint
from engine.kv.pool import KVPool
from engine.kv.table import RequestTable
from engine.kv.tiers import open_tiers
from engine.loop import StepLoop
from engine.model.families import describe
from engine.model.loader import (
    KV_TORCH_DTYPES,
    attention_shape,
    check_shardable,
    load_hf_config,
    load_model,
    model_spec,
    resolve_checkpoint,
)
from engine.model.quantized import weight_footprint
from engine.onednn import cache_capacities
from engine.outputs import Final, RequestOutput, StepResult
from engine.pages import pages_for
from engine.params import InvalidParams, SamplingParams
from engine.prompt import Prompt, Tools, is_chat, is_token_ids
from engine.reasoning import ThinkBlock, ThinkMarkers, think_markers
from engine.request import Group, PromptTooLong, Reply, Req
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.scheduler.snapshot import RequestDetail, SchedulerSnapshot
from engine.scheduler.views import SchedulerView
from engine.speculative.draft import DraftModel, check_same_tokens
from engine.speculative.ngram import NgramProposer
from engine.speculative.speculator import Proposer, Speculator
from engine.structured import GrammarCompiler, GrammarMatcher, GrammarSpec, InvalidGrammar
from engine.threads import ThreadGovernor, usable_cores, wait_policy
from engine.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    default_system,
    eos_token_ids,
    has_chat_template,
    load_tokenizer,
    takes_system_role,
)
from engine.tools import ToolFormat, template_messages, tool_format
from kernels.attention import int8_kv, make_backend
from kernels.cpu import load_cpu_kernels
from kernels.cpu.build import cache_dir
from kernels.quant import BlockMatrix, DeviceBlockWeight

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger(__name__)


LOAD_NICENESS = 5
"""A background load's thread priority. Beside a stream using both of the 2-core machine's cores (measured with
scripts/bench_model_load.py, Gemma 3 270M loading): nice 0 stalled the stream 1.0 s at worst; nice 5 0.25 s, loading
in 8.0 s as at nice 0; nice 10 0.23 s in 11.6 s; nice 19 0.15 s in 26 s."""


def _background_priority() -> None:
    """A loading thread's setting: one OpenMP thread, at LOAD_NICENESS (Linux's niceness is per thread; the main
    thread, which steps the model afterwards, keeps its own). Two OpenMP teams on two cores wait on each other's
    barriers: an engine loading at full priority beside a serving one stalled its stream for a second."""
    torch.set_num_threads(1)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOAD_NICENESS)


def _close_at_exit(ref: weakref.ReferenceType[LLM]) -> None:
    """`LLM.close` for an engine still open when the interpreter exits."""
    llm = ref()
    if llm is not None:
        llm.close()


def _kv_budget_bytes(config: EngineConfig) -> int:
    """Memory for the KV pool when the user gave no page count."""
    if config.kv.kv_memory_gb is not None:
        return int(config.kv.kv_memory_gb * 2**30)
    if config.on_cuda:
        free, _ = torch.cuda.mem_get_info(torch.device(config.execution.device))
        return int(free * 0.85)
    # CPU: a CPU decodes far fewer tokens than a GPU holds, and zeroing a big pool costs start-up time.
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(2**30, available // 8)


def _ranks_here(config: EngineConfig) -> int:
    """The tensor-parallel ranks this machine runs; ValueError where it is not the engine's node or lacks the
    devices."""
    per_node, device = config.parallel.per_node, config.execution.device
    if config.on_cuda and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if config.parallel.node_rank != 0:
        raise ValueError("an engine runs on node 0; a node of rank > 0 only runs its ranks "
                         "(engine/distributed/node.py: minichat serve --node-rank N)")
    if config.on_cuda and torch.cuda.device_count() < (torch.device(device).index or 0) + per_node:
        raise ValueError(f"{per_node} tensor-parallel ranks on this node need that many GPUs from "
                         f"{device}; this machine has {torch.cuda.device_count()}")
    return per_node


class LLM:
    """Load a checkpoint and serve requests through the continuous-batching scheduler, in process."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """`model`: a checkpoint directory, a GGUF file or a hub id (None: the embedded demo model); `options`:
        EngineConfig's flat options, whose defaults and limits are defined there alone."""
        self.config = cfg = EngineConfig.of(model=model, **options)
        per_node = _ranks_here(cfg)
        self.device = torch.device(cfg.execution.device)
        self.checkpoint = resolve_checkpoint(cfg.model_path)
        self.tp = TensorParallel()
        self.workers: WorkerPool | None = None
        self._grammar_lock = threading.Lock()
        # a script may simply end: the tiers' and workers' threads must stop before the interpreter does (a thread
        # still in torch or a file write at finalisation aborted the process, exit 134); weakly, not to keep it alive
        atexit.register(_close_at_exit, weakref.ref(self))
        # CPU threads per rank: the ones asked for, or the usable cores; only a single rank adapts them to the load
        threads = max(1, (cfg.execution.threads or usable_cores()) // per_node)
        self.governor = None
        if self.device.type == "cpu":
            torch.set_num_threads(threads)
            if cfg.execution.threads is None and cfg.parallel.tensor_parallel_size == 1:
                self.governor = ThreadGovernor(threads)
        if cfg.parallel.tensor_parallel_size > 1:
            spec = model_spec(self.checkpoint, load_hf_config(self.checkpoint))
            check_shardable(spec, cfg.parallel.tensor_parallel_size)
            self.tp, self.workers = launch(cfg, spec, str(self.checkpoint.path), threads)
        try:
            if self.device.type == "cpu" and cfg.execution.background_load:
                with ThreadPoolExecutor(1, "minichat-load", initializer=_background_priority) as loader:
                    loader.submit(self._build).result()
                torch.set_num_threads(threads)  # what a thread pool shared process-wide may have taken from the loader
            else:
                self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        """Load this rank's model and size the KV pool (the workers load theirs meanwhile, then get the size)."""
        cfg = self.config
        run, kv = cfg.execution, cfg.kv
        self.model, self.hf_config = load_model(self.checkpoint, run, self.tp)
        self.tokenizer = load_tokenizer(self.checkpoint.meta)
        self.eos_ids = eos_token_ids(self.checkpoint.meta, self.tokenizer, self.hf_config)
        self.generation_defaults = generation_defaults(self.checkpoint.meta)  # the model's own sampling settings
        spec = self.model.spec

        context = spec.max_position_embeddings
        if kv.max_model_len is not None:
            context = min(context, kv.max_model_len)
        num_pages = kv.num_pages
        kv_dtype = KV_TORCH_DTYPES[cfg.kv_dtype]
        if num_pages is None:
            per_page = KVPool.bytes_per_page(spec.num_layers, kv.page_size, self.model.num_kv_heads, spec.head_dim,
                                             kv_dtype)
            demand = cfg.request_slots * pages_for(context, kv.page_size)
            num_pages = max(1, min(demand, _kv_budget_bytes(cfg) // per_page))
        self.num_pages = num_pages
        self.max_seq_len = min(context, num_pages * kv.page_size)
        if self.workers is not None:
            self.workers.expect("loaded")
            self.workers.send(num_pages)
            self.workers.expect("ready")
        backend = make_backend(run.attention_backend, run.device, run.dtype, run.cpu_kernels, spec.full_attention)
        if kv_dtype == torch.int8 and backend.name not in ("cpu", "torch", "triton"):
            raise ValueError(f"kv_cache_dtype 'int8' with the {backend.name} attention backend: int8 KV pages are read "
                             f"by the cpu, torch and triton backends")
        backend.setup(attention_shape(self.model, run.dtype), self.device)
        self.model.use_attention_backend(backend, run.one_call)
        # Worker ranks run every step eagerly, so under tensor parallelism decode is never graphed.
        use_graphs = run.cuda_graph and backend.supports_cuda_graph and self.workers is None
        # CUDA graphs pad decode batches with dummy requests writing to a scratch page no request owns.
        self.kv = KVPool(spec.num_layers, num_pages + int(use_graphs), kv.page_size, self.model.num_kv_heads,
                         spec.head_dim, kv_dtype, self.device)
        self.table = RequestTable(cfg.request_slots, self.max_seq_len, self.device)
        self.cache = make_cache_manager(kv.prefix_cache, num_pages, kv.page_size, self._kv_tiers(backend.name))
        graphs = None
        if use_graphs:
            # Off CUDA (Triton under its interpreter) the same padded path runs without capture.
            graphs = DecodeGraphs(self.model, self.kv, backend, cfg.graph_max_bs,
                                  self.max_seq_len, num_pages * kv.page_size, self.device,
                                  capture=self.device.type == "cuda")
        self.runner = ModelRunner(self.model, self.kv, self.table, backend, self.device, tp=self.tp,
                                  workers=self.workers, graphs=graphs, governor=self.governor)
        self.scheduler = Scheduler(self.runner, self.cache, self.table, self.eos_ids, cfg.scheduler, self._token_text,
                                   self._speculator(num_pages), kv_window=spec.kv_window)
        self.loop = StepLoop(self.scheduler, self.runner)
        self.view = SchedulerView(self.scheduler, self.kv.dtype_name, self.kv.page_bytes)  # what stats, details read
        # requests without a seed draw one from here: from `seed` (reproducible runs), else from the OS, so
        # replicas behind a gateway do not sample in lockstep
        self._rng = torch.Generator().manual_seed(cfg.seed if cfg.seed is not None else secrets.randbits(63))
        self._uid = 0
        self._live: dict[str, Req] = {}
        self._token_texts: dict[int, str] = {}

    def _kv_tiers(self, attention: str) -> KVTiers | None:
        """The tiers under the prefix cache (KVConfig's kv_* fields), keyed by this model's fingerprint: its
        weights' and config's bytes, dtype, weight format, the kernels that compute its K/V (GEMMs and `attention`
        backend: another rounds differently), page size, tensor-parallel and pool layout."""
        cfg, kv = self.config, self.config.kv
        if not cfg.kv_tiers_possible:
            return None
        if kv.kv_host_gib is not None:
            host = int(kv.kv_host_gib * 2**30)
        elif self.device.type == "cuda":
            host = min(self.kv.buffer.numel() * self.kv.buffer.element_size(),
                       os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4)
        else:
            host = 0
        where = Path(kv.kv_cache_dir).expanduser() if kv.kv_cache_dir else default_dir()
        if kv.kv_cache_dir:  # asked for: a directory that cannot be had is an error (the default's is logged, off)
            try:
                where.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"kv_cache_dir {where}: {e.strerror or e}") from e
        disk = int(kv.kv_disk_gib * 2**30) if kv.kv_disk_gib is not None else -1
        if disk < 0:  # the default: 8 GiB, at most half of what the file system has free
            free = shutil.disk_usage(next(p for p in (where, *where.parents) if p.exists())).free
            disk = min(8 << 30, free // 2)
        if not host and not disk:
            return None
        spec = self.model.spec
        run = cfg.execution
        facts = {"dtype": run.dtype, "quantization": run.quantization, "dequantize": run.dequantize,
                 "gemm": self._gemm(), "attention": attention, "page_size": kv.page_size,
                 "tensor_parallel": [cfg.parallel.tensor_parallel_size, self.model.num_kv_heads],
                 "kv": [spec.num_layers, self.model.num_kv_heads, spec.head_dim,
                        int8_kv.LAYOUT if int8_kv.is_int8(self.kv.buffer) else str(self.kv.buffer.dtype)]}
        files = [*self.checkpoint.weight_files(), self.checkpoint.meta / "config.json"]
        return open_tiers(self.kv, fingerprint(files, cache_dir() / WEIGHTS_MEMO, facts), host,
                          where if disk else None, disk, pin=self.device.type == "cuda")

    def _speculator(self, num_pages: int) -> Speculator | None:
        """The proposer `speculative` asks for, if any: prompt lookup, or a draft model loaded beside the target
        (on rank 0, whole: it is small) with a pool of as many pages, and one per slot for its drafts."""
        cfg, spec, run = self.config, self.config.speculation, self.config.execution
        if spec.method == "ngram":
            proposer: Proposer = NgramProposer(cfg.request_slots, spec.speculative_ngram_min,
                                               spec.speculative_ngram_max)
        elif spec.method == "draft":
            assert spec.speculative_model is not None  # checked by SpeculativeConfig
            checkpoint = resolve_checkpoint(spec.speculative_model)
            # a GGUF draft keeps its blocks even where the target's are expanded (`dequantize` is for the target's
            # exactness; verification makes the output exact whatever the draft reads, and reading less is its point)
            model, _ = load_model(checkpoint, replace(run, dequantize=False))
            check_same_tokens(self.tokenizer, load_tokenizer(checkpoint.meta), self.model.spec.vocab_size,
                              model.spec.vocab_size)
            backend = make_backend(run.attention_backend, run.device, run.dtype, run.cpu_kernels)
            backend.setup(attention_shape(model, run.dtype), self.device)
            model.use_attention_backend(backend, run.one_call)
            proposer = DraftModel(model, backend, num_pages + cfg.request_slots, cfg.kv.page_size, cfg.request_slots,
                                  self.max_seq_len, self.device, self.model.spec.vocab_size,
                                  cfg.scheduler.max_prefill_tokens)
        else:
            return None
        return Speculator(proposer, spec.num_speculative_tokens, spec.speculative_adaptive)

    def _token_text(self, token: int) -> str:
        """One token's text, as log-probabilities show it (remembered: the same tokens come back)."""
        if token not in self._token_texts:
            text = self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)
            self._token_texts[token] = text if isinstance(text, str) else "".join(text)
        return self._token_texts[token]

    # -- request intake ---------------------------------------------------------------------------
    @property
    def tool_format(self) -> ToolFormat | None:
        """How this model writes tool calls, read off its chat template (None: it has none)."""
        return tool_format(self.tokenizer)

    @functools.cached_property
    def think_markers(self) -> ThinkMarkers | None:
        """This model's think block, read off its chat template and vocabulary (None: it has none)."""
        return think_markers(self.tokenizer)

    @property
    def system_role(self) -> bool:
        """Whether the chat template renders a system message (some refuse one, some drop it)."""
        return takes_system_role(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        """Whether chat messages can be rendered (engine/tokenizer.has_chat_template)."""
        return has_chat_template(self.tokenizer)

    @property
    def default_system(self) -> str:
        """The system message the chat template adds to a chat that has none ("" if none)."""
        return default_system(self.tokenizer)

    def encode_prompt(self, prompt: Prompt, tools: Tools | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids for a text prompt, chat messages (with `tools` and more `template_kwargs` for the
        template), or ids given directly (checked against the vocab)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer files; pass the prompt as a list of token ids")
            ids = self.tokenizer.encode(prompt)
        elif is_chat(prompt):
            ids = apply_chat_template(self.tokenizer, template_messages(prompt), tools=tools,
                                      template_kwargs=template_kwargs)
        elif is_token_ids(prompt):
            vocab = self.model.spec.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids must be in [0, {vocab}); got {bad[:5]}")
            ids = list(prompt)
        else:
            raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages "
                             "({'role': ..., 'content': ...})")
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, rid: str | None = None,
                    arrival_time: float | None = None, client: str = "", grammar: CompiledGrammar | None = None,
                    tools: Tools | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """Queue a request at the back of the waiting queue; returns its request id. `arrival_time`
        (time.monotonic()) is when it arrived, if earlier than now: its timings count from there.
        `client` labels who sent it, for the stats and `describe`. `grammar`: `params.structured` compiled
        already (`compile_grammar`, off the caller's loop); else it is compiled here. `tools` and
        `template_kwargs` go to the chat template (see `encode_prompt`).
        With `params.n` > 1 the request is a Group of n choices (engine/request.py)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams; got {type(params).__name__}")
        params.validate()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this checkpoint has none")
        vocab = self.model.spec.vocab_size
        outside = sorted(t for t in params.token_ids() if t >= vocab)
        if outside:
            raise InvalidParams(f"logit_bias and stop_token_ids name token ids in [0, {vocab}); got {outside[:5]}")
        if params.thinking_token_budget is not None and self.think_markers is None:
            raise InvalidParams("thinking_token_budget: this model's chat template has no think block")
        compiled = self._compiled(params, grammar)
        ids = self.encode_prompt(prompt, tools, template_kwargs)
        if len(ids) >= self.max_seq_len:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens, but at most {self.max_seq_len - 1} fit "
                                f"(model context {self.model.spec.max_position_embeddings}, KV pool "
                                f"{self.num_pages} pages x {self.config.kv.page_size} tokens); shorten the prompt or "
                                "enlarge the pool")
        rid = rid if rid is not None else uuid.uuid4().hex[:12]
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already in use; choose another")
        # Shrink the output budget to what the context allows (a request
        # that only scores its prompt still samples once, unseen: max_tokens 0 is handled at processing).
        max_output = max(1, min(params.max_tokens, self.max_seq_len - len(ids)))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        group = Group(rid) if params.n > 1 else None
        markers = self.think_markers if params.reasoning else None
        budget = params.thinking_token_budget if params.thinking_token_budget is not None \
            else self.config.reasoning_budget
        for index in range(params.n):
            self._uid += 1
            think = ThinkBlock(markers, ids, budget) if markers is not None else None
            reply = Reply(IncrementalDetokenizer(self.tokenizer, params.stop), scored=1 if index == 0 else len(ids),
                          think=think)
            req = Req(rid=rid if index == 0 else f"{rid}#{index}", uid=self._uid, input_ids=ids, params=params,
                      max_output=max_output, seed=seed + index, group=group, client=client, reply=reply,
                      grammar=self._matcher(compiled, think))
            if arrival_time is not None:
                req.times.arrival = arrival_time
            if group is not None:
                group.members.append(req)
            if index == 0:
                self._live[rid] = req
            self.scheduler.add_request(req)
        return rid

    def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """`spec` compiled against this model's vocabulary (xgrammar caches it by its text); InvalidParams for a
        grammar that cannot work. Thread-safe: a grammar's cost is the client's to choose, so the server runs
        this off its loop and hands the result to `add_request`."""
        if self.tokenizer is None:
            raise InvalidParams("structured output needs a tokenizer, and this checkpoint has none")
        try:
            with self._grammar_lock:  # built once, on whichever thread first needs it
                if self.scheduler.grammar is None:
                    self.scheduler.grammar = GrammarCompiler(self.tokenizer, self.model.spec.vocab_size, self.eos_ids)
            return self.scheduler.grammar.compile(spec)
        except InvalidGrammar as e:
            raise InvalidParams(f"structured: {e}") from e

    def _compiled(self, params: SamplingParams, compiled: CompiledGrammar | None) -> CompiledGrammar | None:
        """`params.structured` compiled (None without it), or `compiled` when the caller compiled it already;
        InvalidParams for a grammar that cannot work, before anything queues."""
        if params.structured is None:
            return None
        return compiled if compiled is not None else self.compile_grammar(params.structured)

    def _matcher(self, compiled: CompiledGrammar | None, think: ThinkBlock | None) -> GrammarMatcher | None:
        """A choice's matcher of `compiled`, for the answer after `think` when there is one."""
        if compiled is None:
            return None
        compiler = self.scheduler.grammar
        assert compiler is not None  # compile_grammar made it
        return compiler.matcher(compiled, after=think)

    # -- stepping ---------------------------------------------------------------------------------
    def step(self, overlap: bool = False) -> StepResult:
        """Schedule, run and process one batch. With `overlap` (what `generate` and the server use when
        `EngineConfig.overlap` is on) the next batch is scheduled and started before this one is
        processed; a plain `step()` after overlapped ones first finishes the batch still in flight."""
        result = self.loop.step(overlap)
        for rid in result.finished:
            self._live.pop(rid, None)
        return result

    def abort(self, rid: str) -> None:
        if not self.scheduler.abort(rid):
            raise ValueError(f"unknown request id {rid!r} (never added, or already finished)")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def describe(self, rid: str, text_from: int = 0) -> RequestDetail[tuple[int, ...]] | None:
        """One live request in detail (Scheduler.describe); None when it is not live."""
        return self.view.describe(rid, text_from)

    def request(self, rid: str) -> Req | None:
        """A live (not yet finished) request, for inspection."""
        return self._live.get(rid)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (what the server's overload limit counts), without a snapshot."""
        return self.scheduler.num_waiting

    @property
    def model_info(self) -> dict[str, str]:
        """What the model is: family, architecture, layers, attention, experts, windows (the console, `minichat
        status` and /v1/models show it)."""
        return describe(self.model.spec)

    @property
    def execution(self) -> dict[str, str]:
        """What the execution options resolved to on this machine: `auto` choices and any fallback
        (the C kernels off where no compiler builds them, say)."""
        gemm = self._gemm()
        formats, size = weight_footprint(self.model)
        total = sum(formats.values())
        main = [name for name, count in sorted(formats.items(), key=lambda f: -f[1]) if count >= 0.01 * total]
        execution = {"request_slots": str(self.config.request_slots), "attention_backend": self.runner.backend.name,
                     "weights": f"{'+'.join(main)}, {size / 2**20:.1f} MiB{self._kept_rows()}", "gemm": gemm,
                     "cpu_kernels": f"on ({self.model.kernels.isa})" if self.model.kernels is not None else "off",
                     **self.model.execution(), "overlap": "on" if self.config.use_overlap else "off"}
        spec = self.config.speculation
        if spec.method is not None:
            source = "prompt lookup" if spec.method == "ngram" else \
                f"draft model {model_id(str(spec.speculative_model))}"
            execution["speculative"] = (f"{source}, up to {spec.num_speculative_tokens} drafts a step (as many as "
                                        "measure faster)")
        execution["kv_tiers"] = ", ".join(f"{t.name} {t.capacity_bytes / 2**30:.1f} GiB"
                                          + (f" in {t.where}" if t.where else "") for t in self.cache.tier_use()) \
            or "none below the pool"
        if self.device.type == "cuda":
            graphed = f"decode batches up to {self.config.graph_max_bs}"
            execution["cuda_graph"] = graphed if self.runner.graphs else "off"
        if self.device.type == "cpu":
            execution["threads"] = self._threads()
            execution["omp_wait"] = wait_policy()
            execution["onednn_caches"] = cache_capacities()
        return execution

    def _kept_rows(self) -> str:
        """The second copy of a float model's rows the one-call path reads (CausalLM.keep_float_rows), if any."""
        model = self.model
        kept = [w for ws in model.float_rows or () for w in ws] + ([model.head_rows] if model.head_rows else [])
        if not kept:
            return ""
        return f" (+{sum(w.nbytes for w in kept) / 2**20:.1f} MiB of {'+'.join(kept[0].formats)} rows kept)"

    def _gemm(self) -> str:
        """Where the projections run: their weights' format or dtype, and whose kernels."""
        weight = self.model.layers[0].qkv_proj.weight
        if isinstance(weight, BlockMatrix):
            return f"{'+'.join(weight.formats)} blocks, minichat's {load_cpu_kernels().isa} kernels"
        if isinstance(weight, DeviceBlockWeight):
            return f"{'+'.join(weight.formats)} as int8 + scales, minichat's Triton weight-only kernel"
        return str(weight.dtype).removeprefix("torch.") + (" prepacked" if weight.is_mkldnn else "")

    def _threads(self) -> str:
        g = self.governor
        if g is not None:
            return f"up to {g.limit}, the team size that measures faster (now {g.current})"
        if self.workers is not None:
            ranks = zip(self.workers.ranks, self.workers.threads, strict=True)
            return f"rank 0: {torch.get_num_threads()}; " + "; ".join(f"rank {r}: {t}" for r, t in ranks)
        return str(torch.get_num_threads())

    def stats(self, changed_pages: set[int] | None = None) -> SchedulerSnapshot:
        """A read-only snapshot of the scheduler: waiting queue, running set, slots, pages, counters; every
        page, or only those in `changed_pages` (a set from `watch_pages`)."""
        return self.view.snapshot(changed_pages)

    def watch_pages(self) -> set[int]:
        """A set each `stats()` adds the KV pages whose state changed to (the caller empties it)."""
        return self.view.watch_pages()

    def check_integrity(self) -> None:
        """At idle every page is free or cached and every slot free; raise AssertionError otherwise.

        Worker ranks hold no page state of their own (rank 0's allocator places every rank's K/V, so
        pages freed here are freed on every rank); for them the check is that each ran exactly the
        steps rank 0 sent."""
        self.cache.check_integrity(idle=not self.has_unfinished())
        self.scheduler.check_requests()
        if not self.has_unfinished():
            held = [h for h in self.table.holder if h is not None]
            if held or self.cache.allocator.owner:
                raise AssertionError(f"idle engine still holds slots {held} / pages {self.cache.allocator.owner}")
            if self.workers is not None:  # only at idle: no batch in flight on the model thread
                self.workers.check_in_step()

    # -- lifetime ---------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise WorkerFailed if a tensor-parallel worker rank has died (the server calls this when idle)."""
        if self.workers is not None:
            self.workers.check()

    def write_behind(self) -> bool:
        """At idle: write down the KV pages that waited for room on their way to disk; True while some still wait
        (the idle loop comes back soon rather than leave them until the next request)."""
        return self.scheduler.write_behind()

    def flush_kv(self, timeout: float = 60.0) -> bool:
        """Write every cached KV page down to the disk tier and wait for the writes (at idle: every page is then
        final); False if that took longer than `timeout` seconds. Nothing to do without a disk tier."""
        return self.cache.flush(timeout)

    def close(self) -> None:
        """Write the cached KV pages down and stop the tiers' threads; stop the worker ranks (if any)."""
        if hasattr(self, "cache"):
            self.cache.close()
        if self.workers is not None:
            self.workers.close()
        self.tp.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- offline ----------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion through the scheduler; outputs come back in prompt order (a prompt
        with n > 1 choices gives n outputs in a row, by `index`)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} sampling params")
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        reqs = {rid: self._live[rid] for rid in rids}
        finals: dict[str, Final] = {}
        with tqdm(total=len(rids), desc="generate", disable=not use_tqdm) as bar:
            while len(finals) < len(rids):
                for out in self.step(self.config.use_overlap).outputs:
                    if isinstance(out, Final) and out.rid in reqs:
                        finals[out.rid] = out
                        bar.update()
        if self.loop.has_inflight:  # settle: the batch scheduled ahead may still hold finished requests' pages
            self.step()
        return [_output(choice, finals[rid]) for rid in rids for choice in _choices(reqs[rid])]


def _choices(req: Req) -> list[Req]:
    return req.group.members if req.group is not None else [req]


def _output(req: Req, final: Final) -> RequestOutput:
    """One choice of a whole request: every token and the whole text, the request's timings, its own
    finish reason and token count."""
    usage = msgspec.structs.replace(final.usage, completion_tokens=len(req.output_ids),
                                    reasoning_tokens=req.reply.think.tokens if req.reply.think is not None else 0)
    detokenizer = req.reply.detokenizer
    return RequestOutput(rid=req.client_rid, index=req.index, text=detokenizer.text if detokenizer else "",
                         token_ids=list(req.output_ids), finish_reason=req.finish_reason or final.finish_reason,
                         usage=usage, timings=final.timings, prompt_token_ids=req.input_ids,
                         logprobs=None if req.params.logprobs is None else req.reply.logprobs,
                         prompt_logprobs=req.reply.prompt_logprobs,
                         reasoning=detokenizer.reasoning if detokenizer else "",
                         stop_string=detokenizer.matched if detokenizer else None)
