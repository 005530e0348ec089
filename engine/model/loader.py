"""Find a checkpoint directory, read its config, and load its safetensors into our model."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from engine.config import DTYPES
from engine.distributed import TensorParallel
from engine.model.llama import CausalLM, ModelSpec
from engine.model.ops import resolve_linear_dtype
from engine.model.parallel import TensorSlice, prepack_linear_weights, set_linear_dtype
from kernels.attention.base import AttentionShape
from kernels.cpu import KernelBuildError, load_cpu_kernels, supported

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def resolve_model_path(model: str) -> Path:
    """A local checkpoint directory, or a hub id already in the local HF cache (downloaded if allowed)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a directory but has no config.json; point --model at an HF "
                             f"checkpoint directory (config.json + *.safetensors)")
        return path
    if path.exists() or model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ValueError(f"model {model!r} is not a checkpoint directory, and not a hub id of the form "
                         f"'org/name'")
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


def load_hf_config(path: Path) -> PretrainedConfig:
    from transformers import AutoConfig  # here, so that workers (which get a ModelSpec) never import it

    return AutoConfig.from_pretrained(path)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def _read_tensors(path: Path) -> Iterator[tuple[str, TensorSlice]]:
    """Every checkpoint tensor as a lazy slice: a tensor-parallel rank reads only its own part."""
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_slice(name)


def check_shardable(spec: ModelSpec, size: int) -> None:
    """Raise ValueError if the model's heads, intermediate size or vocabulary do not split over `size`
    ranks (before any process is started for them)."""
    with torch.device("meta"):
        CausalLM(spec, TensorParallel(rank=0, size=size))


def load_model(path: Path, dtype: str, device: str, tp: TensorParallel | None = None,
               linear_dtype: str = "auto", prepack_weights: bool = True,
               cpu_kernels: bool = True) -> tuple[CausalLM, PretrainedConfig]:
    """Build the model for `path`'s architecture (this rank's shard of it, under tensor parallelism)
    and fill it from the checkpoint's tensors."""
    hf_config = load_hf_config(path)
    return build_model(ModelSpec.from_hf_config(hf_config), path, dtype, device, tp, linear_dtype,
                       prepack_weights, cpu_kernels), hf_config


def build_model(spec: ModelSpec, path: Path, dtype: str, device: str, tp: TensorParallel | None = None,
                linear_dtype: str = "auto", prepack_weights: bool = True, cpu_kernels: bool = True) -> CausalLM:
    """The model `spec` describes (this rank's shard), filled from the safetensors in `path`, its
    projections stored in `linear_dtype` and, on the CPU in float32, prepacked for oneDNN, its norms
    and RoPE in the C kernels (EngineConfig.linear_dtype, .prepack_weights, .cpu_kernels)."""
    with torch.device("meta"):  # no time spent initialising weights the checkpoint overwrites
        model = CausalLM(spec, tp).to(TORCH_DTYPES[dtype])
    model = model.to_empty(device=device)
    try:
        model.load_weights(_read_tensors(path))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    set_linear_dtype(model, resolve_linear_dtype(linear_dtype, TORCH_DTYPES[dtype], torch.device(device)))
    if prepack_weights:
        prepack_linear_weights(model)
        for layer in model.layers:
            layer.fuse_residual_adds()
    if cpu_kernels and supported(device, TORCH_DTYPES[dtype]):
        try:
            model.use_cpu_kernels(load_cpu_kernels())
        except KernelBuildError as e:
            log.warning("minichat's CPU kernels are unavailable, running the torch paths instead: %s", e)
    model.eval()
    return model


def attention_shape(model: CausalLM, dtype: str) -> AttentionShape:
    """What an attention backend must know of a loaded model (this rank's heads under tensor parallelism)."""
    spec = model.spec
    return AttentionShape(model.layers[0].num_heads, model.num_kv_heads, spec.head_dim, TORCH_DTYPES[dtype],
                          spec.head_dim**-0.5)
