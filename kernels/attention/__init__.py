"""Attention backends behind one interface, chosen by name; optional ones are imported only when used."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable

import torch

from kernels.attention.base import AttentionBackend, AttentionMetadata, AttentionShape, build_metadata

BACKENDS = {
    "torch": "kernels.attention.torch_ref:TorchRefBackend",
    "cpu": "kernels.attention.cpu:CpuBackend",
    "triton": "kernels.attention.triton:TritonBackend",
    "flashinfer": "kernels.attention.flashinfer:FlashInferBackend",
}
"""name -> "module:class"; a backend module is imported only when its name is asked for."""


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend_name(name: str, device: str, dtype: str = "bfloat16", cpu_kernels: bool = True,
                         full_attention: bool = True) -> str:
    """`auto` is the best backend the device can run (FlashInfer, then Triton on CUDA; on the CPU, minichat's
    C kernels where they build, unless `cpu_kernels` is off; torch elsewhere); other names pass through
    after checking that this device, dtype and environment can run them. A model with sliding windows or capped
    scores (`full_attention` False) is not FlashInfer's."""
    if name == "auto":
        return _best_backend(device, dtype, cpu_kernels, full_attention)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(BACKENDS)}")
    check = _CHECKS.get(name)
    if check is not None:
        check(device, dtype)
    return name


def _best_backend(device: str, dtype: str, cpu_kernels: bool, full_attention: bool) -> str:
    if device.startswith("cuda"):
        if dtype != "float32" and full_attention and _installed("flashinfer"):  # FlashInfer takes bf16/fp16 only
            return "flashinfer"
        return "triton" if _installed("triton") else "torch"
    from kernels.cpu import cpu_kernels_available, supported

    if cpu_kernels and supported(device, getattr(torch, dtype)):
        return "cpu" if cpu_kernels_available() else "torch"
    return "torch"


def _check_cpu(device: str, dtype: str) -> None:
    from kernels.cpu import KernelBuildError, load_cpu_kernels, require_supported

    require_supported(device, getattr(torch, dtype))
    try:
        load_cpu_kernels()
    except KernelBuildError as e:
        raise ValueError(f"the cpu attention backend's C kernels cannot be built here: {e}; use "
                         "attention_backend='torch'") from e


def _check_flashinfer(device: str, dtype: str) -> None:
    if not device.startswith("cuda"):
        raise ValueError("the flashinfer attention backend runs only on CUDA; use device='cuda' or "
                         "attention_backend='torch'")
    if not _installed("flashinfer"):
        raise ValueError("the flashinfer attention backend needs flashinfer-python "
                         "(pip install 'minichat[gpu]'); or use attention_backend='triton'")
    if dtype == "float32":
        raise ValueError("the flashinfer attention backend needs dtype bfloat16 or float16; "
                         "use attention_backend='triton' for float32")


def _check_triton(device: str, dtype: str) -> None:
    if not _installed("triton"):
        raise ValueError("the triton attention backend needs triton (pip install 'minichat[gpu]')")
    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the triton attention backend needs a CUDA device (got {device!r}); on a CPU it "
                         "runs only under the Triton interpreter: set TRITON_INTERPRET=1 before starting")


_CHECKS: dict[str, Callable[[str, str], None]] = {"cpu": _check_cpu, "flashinfer": _check_flashinfer,
                                                  "triton": _check_triton}
"""backend name -> raise ValueError saying why this device, dtype or environment cannot run it (torch runs anywhere)."""


def make_backend(name: str, device: str, dtype: str = "bfloat16", cpu_kernels: bool = True,
                 full_attention: bool = True) -> AttentionBackend:
    """Instantiate the backend registered under `name` (or picked by `auto`) for `device` and `dtype`."""
    module, cls = BACKENDS[resolve_backend_name(name, device, dtype, cpu_kernels, full_attention)].split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "AttentionShape", "build_metadata", "make_backend",
           "resolve_backend_name"]
