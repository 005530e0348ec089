"""Find a checkpoint (a directory of safetensors or a GGUF file), read its config, and load its weights into
our model: as float tensors, or kept in block formats (engine/model/quantized.py)."""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from engine.config import DTYPES, ExecutionConfig, model_id
from engine.distributed import TensorParallel
from engine.model.decoder import CausalLM, ModelSpec
from engine.model.families import build, read_spec
from engine.model.gguf import (
    SUFFIX,
    GGUFCheckpoint,
    block_tensor_names,
    is_gguf,
    open_gguf,
    read_tensors,
    rope_factors,
)
from engine.model.ops import resolve_linear_dtype
from engine.model.parallel import QUANTIZABLE, Source, TensorSlice, prepack_linear_weights, set_linear_dtype
from engine.model.quantized import QUANTIZATIONS, plan_block_weights
from kernels.attention.base import AttentionShape
from kernels.cpu import KernelBuildError, cpu_kernels_available, load_cpu_kernels, supported
from kernels.cpu.hugepages import block_matrices, gather_into_huge_pages
from kernels.quant import QTYPES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}
KV_TORCH_DTYPES = {**TORCH_DTYPES, "int8": torch.int8}
"""What KV pages are stored as, by EngineConfig.kv_dtype (int8: rows and their scales, kernels/attention/int8_kv)."""


def resolve_model_path(model: str) -> Path:
    """A local checkpoint directory, or a hub id already in the local HF cache (downloaded if allowed)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a directory but has no config.json; point --model at an HF "
                             f"checkpoint directory (config.json + *.safetensors) or a .gguf file")
        return path
    if path.exists() or model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ValueError(f"model {model!r} is not a checkpoint directory or a .gguf file, and not a hub id of "
                         f"the form 'org/name'")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(model, local_files_only=True, allow_patterns=patterns))
    except Exception as cached_err:
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            raise ValueError(f"model {model!r}: no such directory, and not in the local HF cache "
                             f"({HF_HUB_CACHE}); HF_HUB_OFFLINE is set, so no download was tried") from cached_err
        try:
            return Path(snapshot_download(model, allow_patterns=patterns))
        except Exception as download_err:
            raise ValueError(f"model {model!r}: no such directory, not in the local HF cache ({HF_HUB_CACHE}), "
                             f"and downloading it failed: {download_err}") from download_err


@dataclass(frozen=True)
class Checkpoint:
    """What `--model` names: a directory of safetensors, or one GGUF file (`gguf`), whose config and tokenizer
    then live in a directory converted from its metadata (engine/model/gguf.py)."""

    path: Path
    gguf: GGUFCheckpoint | None = None

    @property
    def meta(self) -> Path:
        """The directory with config.json, the tokenizer and generation_config.json."""
        return self.gguf.meta if self.gguf is not None else self.path

    @property
    def name(self) -> str:
        """The model id clients see."""
        return model_id(str(self.path))

    def weight_files(self) -> list[Path]:
        """The files the weights come from: the GGUF file, or the directory's safetensors."""
        return [self.path] if self.gguf is not None else _weight_files(self.path)

    def formats(self) -> dict[str, int]:
        """The checkpoint's weight formats and how many tensors each (safetensors: by dtype)."""
        if self.gguf is not None:
            return self.gguf.formats
        counts: dict[str, int] = {}
        for file in _weight_files(self.path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    dtype = f.get_slice(name).get_dtype()
                    counts[dtype] = counts.get(dtype, 0) + 1
        return counts


def resolve_checkpoint(model: str) -> Checkpoint:
    """A GGUF file, a local checkpoint directory, or a hub id already in the local HF cache."""
    path = Path(model).expanduser()
    if is_gguf(path):
        return Checkpoint(path, open_gguf(path))
    if path.suffix == SUFFIX:
        raise ValueError(f"{path}: no such GGUF file")
    return Checkpoint(resolve_model_path(model))


def load_hf_config(checkpoint: Checkpoint) -> PretrainedConfig:
    from transformers import AutoConfig  # here, so that workers (which get a ModelSpec) never import it

    return AutoConfig.from_pretrained(checkpoint.meta)


def model_spec(checkpoint: Checkpoint, hf_config: PretrainedConfig) -> ModelSpec:
    """The model's shape from its config, with a GGUF file's RoPE divisors applied (engine/model/gguf.py)."""
    spec = read_spec(hf_config)
    factors = rope_factors(checkpoint.gguf) if checkpoint.gguf is not None else None
    if factors is not None:
        rope = spec.ropes[0]
        if factors.shape != rope.inv_freq.shape:
            raise ValueError(f"{checkpoint.path}: rope_freqs has {factors.numel()} values for "
                             f"{rope.inv_freq.numel()} frequencies")
        rope.inv_freq = rope.inv_freq / factors
    return spec


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights (point --model at a checkpoint directory of "
                         f"safetensors, or at a .gguf file)")
    return files


def _read_safetensors(path: Path) -> Iterator[tuple[str, TensorSlice]]:
    """Every checkpoint tensor as a lazy slice: a tensor-parallel rank reads only its own part."""
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_slice(name)


def check_shardable(spec: ModelSpec, size: int) -> None:
    """Raise ValueError if the model's heads, intermediate size or vocabulary do not split over `size`
    ranks (before any process is started for them)."""
    with torch.device("meta"):
        build(spec, TensorParallel(rank=0, size=size))


def load_model(checkpoint: Checkpoint, options: ExecutionConfig,
               tp: TensorParallel | None = None) -> tuple[CausalLM, PretrainedConfig]:
    """Build the model for the checkpoint's architecture (this rank's shard of it, under tensor parallelism)
    and fill it from the checkpoint's tensors."""
    hf_config = load_hf_config(checkpoint)
    return build_model(model_spec(checkpoint, hf_config), checkpoint, options, tp), hf_config


def build_model(spec: ModelSpec, checkpoint: Checkpoint, options: ExecutionConfig,
                tp: TensorParallel | None = None) -> CausalLM:
    """The model `spec` describes (this rank's shard), filled from the checkpoint, as `options` say."""
    dtype = TORCH_DTYPES[options.dtype]
    with torch.device("meta"):  # no time spent initialising weights the checkpoint overwrites
        model = build(spec, tp).to(dtype)
    targets = model.weight_targets()
    gguf = checkpoint.gguf
    if gguf is not None:
        tensors: Iterable[tuple[str, Source]] = read_tensors(gguf, list(targets), spec.num_layers, spec.num_heads,
                                                             spec.num_kv_heads)
    else:
        tensors = _read_safetensors(checkpoint.path)
    block_names = set() if gguf is None or options.dequantize else block_tensor_names(gguf, list(targets),
                                                                                      spec.num_layers)
    quantize_to = QTYPES[QUANTIZATIONS[options.quantization]] if options.quantization else None
    if block_names or quantize_to is not None:
        try:  # the C kernels unpack the blocks at load on every device, and multiply by them on the CPU
            kernels = load_cpu_kernels()
        except KernelBuildError as e:
            raise ValueError(f"quantized weights need minichat's CPU kernels, which cannot be built here: {e}") from e
        if options.device != "cpu":
            try:
                importlib.import_module("kernels.triton.quant")  # the GPU's weight-only products
            except ImportError as e:
                raise ValueError(f"weights in block formats on {options.device} need Triton ({e}); install the "
                                 f"gpu extra, or load the GGUF file with --dequantize") from e
        plan_block_weights(model, targets, block_names, quantize_to, QUANTIZABLE, kernels, torch.device(options.device))
    model = model.to_empty(device=options.device)
    try:
        model.load_weights(tensors)
    except ValueError as e:
        raise ValueError(f"{checkpoint.path}: {e}") from e
    set_linear_dtype(model, resolve_linear_dtype(options.linear_dtype, dtype, torch.device(options.device)))
    if options.cpu_kernels and options.device == "cpu" and dtype == torch.float32 and cpu_kernels_available():
        model.keep_float_rows(load_cpu_kernels())  # decode steps in one C call (before prepacking replaces the rows)
    weights_in_huge_pages(model, options.device)
    if options.prepack_weights:
        prepack_linear_weights(model)
    if options.cpu_kernels and supported(options.device, dtype):
        try:
            model.use_cpu_kernels(load_cpu_kernels())
        except KernelBuildError as e:
            log.warning("minichat's CPU kernels are unavailable, running the torch paths instead: %s", e)
    model.eval()
    return model


def weights_in_huge_pages(model: CausalLM, device: str) -> None:
    """On a CPU, the model's repacked weights into one buffer of 2 MiB pages (kernels/cpu/hugepages.py): a decode
    step streams every weight once, with 512 times fewer TLB misses there. Before the kernels build their views."""
    if device == "cpu":
        moved = gather_into_huge_pages(block_matrices(model))
        if moved:
            log.info("%.1f MiB of weights in one buffer of huge pages", moved / 2**20)


def attention_shape(model: CausalLM, dtype: str) -> AttentionShape:
    """What an attention backend must know of a loaded model (this rank's heads under tensor parallelism)."""
    spec = model.spec
    return AttentionShape(model.layers[0].num_heads, model.num_kv_heads, spec.head_dim, TORCH_DTYPES[dtype],
                          spec.scale, windows=frozenset(spec.windows), softcap=spec.softcap)
