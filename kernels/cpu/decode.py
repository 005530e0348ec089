"""A model's layers in one C call (kernels/cpu/decode.c), for a model whose projections are all in block formats.

`FusedLayers` holds the C view of every layer (the weights' segments, norms, biases, this layer's KV pool) once;
a call runs the step's tokens through all of them in one OpenMP parallel region, with the same functions the
per-call path uses, so the two compute the same numbers. What it takes is what the CPU attention backend's
decode and prefill steps already carry (kernels/attention/cpu.py: `PagedStep`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.attention.int8_kv import is_int8
from kernels.cpu import GATED_INPUTS, CpuKernels
from kernels.quant import BlockMatrix

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Product(ctypes.Structure):
    _fields_ = [("segs", _P), ("nseg", _I), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("attn_out_norm", _P),
                ("mlp_out_norm", _P), ("cos", _P), ("signed_sin", _P), ("qkv", _Product), ("o", _Product),
                ("gate_up", _Product), ("down", _Product), ("k_cache", _P), ("v_cache", _P), ("window", _I)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("inter", _I), ("eps", _F), ("scale", _F), ("activation", ctypes.c_int32), ("kv_q8", ctypes.c_int32),
                ("layers", _P)]


Projection = tuple[BlockMatrix, torch.Tensor | None]
"""A product's weight and its bias."""


@dataclass
class LayerWeights:
    """What decode.c needs of one layer: float32 norm gains (the norm before attention, the one before the MLP,
    q/k norms or None, Gemma's norms of each half's output or None), its RoPE tables ([positions, head_dim]
    float32 cos and signed sin), the four products, the layer's K and V pools ([locations, kv heads, head dim]
    float32, or int8 rows: kernels/attention/int8_kv.py), its attention window (0: none)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    attn_out_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
    cos: torch.Tensor
    signed_sin: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    window: int = 0


class FusedLayers:
    """Every layer of a model in one C call; holds references to everything the C view points into."""

    def __init__(self, kernels: CpuKernels, layers: list[LayerWeights], heads: int, kv_heads: int, head_dim: int,
                 eps: float, scale: float, activation: str) -> None:
        self._keep: list[object] = []
        views = [self._layer(kernels, w) for w in layers]
        self._layers = (_Layer * len(views))(*views)
        hidden, inter = layers[0].qkv[0].in_features, layers[0].down[0].in_features
        self._model = _Model(len(views), hidden, heads, kv_heads, head_dim, inter, eps, scale,
                             GATED_INPUTS[activation], int(is_int8(layers[0].k_cache)), ctypes.addressof(self._layers))
        self.hidden = hidden
        for name, mirror in (("product", _Product), ("layer_plan", _Layer), ("model_plan", _Model)):
            kernels.check_struct(name, mirror)
        self._fn = kernels.lib.q_decode_layers
        self._fn.argtypes = [_P, _I, _P, _P, _P, _I, _P, _P, _P]
        self._fn.restype = ctypes.c_int32

    def _tensor(self, t: torch.Tensor | None, numel: int | None = None) -> int | None:
        if t is None:
            return None
        if t.dtype != torch.float32 or not t.is_contiguous() or (numel is not None and t.numel() != numel):
            raise ValueError("the fused layers need contiguous float32 norms, biases and pools of the model's shape")
        self._keep.append(t)
        return t.data_ptr()

    def _product(self, kernels: CpuKernels, projection: Projection) -> _Product:
        weight, bias = projection
        segs = kernels.segments(weight)
        self._keep.append(weight)
        return _Product(ctypes.addressof(segs), len(weight.segments), self._tensor(bias, weight.out_features))

    def _layer(self, kernels: CpuKernels, w: LayerWeights) -> _Layer:
        if w.cos.shape != w.signed_sin.shape:
            raise ValueError("the fused layers need cos and signed sin tables of one shape")
        return _Layer(self._tensor(w.input_norm), self._tensor(w.post_norm), self._tensor(w.q_norm),
                      self._tensor(w.k_norm), self._tensor(w.attn_out_norm), self._tensor(w.mlp_out_norm),
                      self._tensor(w.cos), self._tensor(w.signed_sin), self._product(kernels, w.qkv),
                      self._product(kernels, w.o), self._product(kernels, w.gate_up), self._product(kernels, w.down),
                      self._pool(w.k_cache), self._pool(w.v_cache), w.window)

    def _pool(self, t: torch.Tensor) -> int:
        if not t.is_contiguous() or t.dtype not in (torch.float32, torch.int8):
            raise ValueError("the fused layers need contiguous float32 or int8 KV pools")
        self._keep.append(t)
        return t.data_ptr()

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                 kv_lens: torch.Tensor, out_locs: torch.Tensor) -> None:
        """x ([tokens, hidden] float32, contiguous) through every layer, in place; token t at positions[t]
        writes its K/V to out_locs[t] and attends to the first kv_lens[t] KV locations of table row rows[t]."""
        tokens = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self.hidden or table.stride(1) != 1:
            raise ValueError(f"the fused layers take contiguous float32 [tokens, {self.hidden}] and a unit-stride "
                             f"table")
        index = [t.contiguous() for t in (positions, rows, kv_lens, out_locs)]
        if any(t.dtype != torch.int64 or t.numel() != tokens for t in index) or table.dtype != torch.int64:
            raise ValueError("the fused layers take int64 positions, rows, kv_lens and KV locations, one per token")
        positions, rows, kv_lens, out_locs = index
        if self._fn(x.data_ptr(), tokens, ctypes.byref(self._model), positions.data_ptr(), table.data_ptr(),
                    table.stride(0), rows.data_ptr(), kv_lens.data_ptr(), out_locs.data_ptr()):
            raise MemoryError(f"fused layers: no memory for a step of {tokens} tokens")
