"""Attention backends behind one interface, chosen by name; optional ones are imported only when used."""

from __future__ import annotations

import importlib

from kernels.attention.base import AttentionBackend, AttentionMetadata, build_metadata

BACKENDS = {"torch": "kernels.attention.torch_ref:TorchRefBackend"}
"""name -> "module:class"; a backend module is imported only when its name is asked for."""


def resolve_backend_name(name: str, device: str) -> str:
    """`auto` is the best backend the device can run; other names pass through after a check."""
    if name == "auto":
        return "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(BACKENDS)}")
    return name


def make_backend(name: str, device: str) -> AttentionBackend:
    """Instantiate the backend registered under `name` (or picked by `auto`) for `device`."""
    module, cls = BACKENDS[resolve_backend_name(name, device)].split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "build_metadata", "make_backend",
           "resolve_backend_name"]
