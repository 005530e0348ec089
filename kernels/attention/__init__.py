"""Attention backends behind one interface; `make_backend` picks one for the device."""

from kernels.attention.base import AttentionBackend, AttentionBatch
from kernels.attention.torch_ref import TorchRefBackend


def make_backend(name: str, device: str) -> AttentionBackend:
    """`auto` is the torch reference on CPU; GPU backends register here as they land."""
    if name in ("auto", "torch"):
        return TorchRefBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch")


__all__ = ["AttentionBackend", "AttentionBatch", "TorchRefBackend", "make_backend"]
