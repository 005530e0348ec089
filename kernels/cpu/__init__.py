"""minichat's C kernels for the CPU step: attention over the paged pool, RMSNorm, RoPE, the MLP
activation between float32 GEMMs, and products with weights in GGML's block formats (quant.c).

They take float32 and bfloat16 tensors (the dtypes a CPU model runs in) and are called through ctypes
with raw pointers, so every wrapper checks layout before handing a pointer over. `load_cpu_kernels`
builds the library at first use (kernels/cpu/build.py) and raises `KernelBuildError` where it cannot.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from kernels.attention.int8_kv import is_int8, row_bytes
from kernels.cpu.build import KernelBuildError, chosen_isa, load_library
from kernels.quant import PANEL, BlockMatrix, QType, Segment

SUPPORTED_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_attention": [ctypes.c_void_p],  # a pointer to an _Attention
    "rms_norm": [_P, _P, _I, _P, _I, _I, _F],
    "rope": [_P, _I, _I, _I, _P, _P, _P, _I],
    "silu_mul": [_P, _P, _I, _I],  # by the model dtype whose roundings it keeps; always float32 data
}


_QUANT_SIGNATURES = {
    "q_linear": [ctypes.c_void_p],  # a pointer to a _Linear
    "q_dequantize": [_P, _P, _I, _P, _I, ctypes.c_int32],
    "q_repack": [_P, _P, _I, _I, _I, ctypes.c_int32],
    "q_quantize_act": [_P, _P, _I, _I],
    "q_expand": [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int32],
    "q_dequantize_dense": [_P, _P, _I, _I, _I, _I],
}


INPUT_RMS_NORM = 1  # quant.c's transforms of the product's input (quant.h)
GATED_INPUTS = {None: 0, "silu": 2, "gelu_tanh": 3}
"""q_linear's `gated` as quant.h numbers the input transform: none, SiLU(gate) * up, GELU-tanh(gate) * up."""
DENSE_ROWS = 64
"""Without VNNI, from this many rows a product with a block-format weight expands the weight and runs torch's float32
GEMM (measured faster from here on with AVX2's maddubs; the integer kernel wins below, where reading the weights is
the cost). With VNNI's dot products the integer kernel wins at every size: 1.2-2.0x the expanded GEMM at 64 to 512
rows (AMD EPYC Zen 4, 2 threads, Q4_0/Q4_1/Q8_0/Q4_K; Q6_K 0.92-1.19x), so it never expands."""


class _Segment(ctypes.Structure):
    """quant.h's `segment`: rows of one format and the first output column they fill."""

    _fields_ = [("type", ctypes.c_int32), ("data", ctypes.c_void_p), ("rows", ctypes.c_int64),
                ("col", ctypes.c_int64)]


class _Linear(ctypes.Structure):
    """quant.h's `linear_call`: one q_linear product's arguments by name."""

    _fields_ = [("out", _P), ("out_stride", _I), ("x", _P), ("x_stride", _I), ("m", _I), ("k", _I),
                ("input", ctypes.c_int32), ("norm_weight", _P), ("eps", _F), ("segs", ctypes.POINTER(_Segment)),
                ("nseg", _I),
                ("bias", _P), ("add", _P), ("add_stride", _I)]


class _Attention(ctypes.Structure):
    """attention.h's `attention_call` (its comments say what each field is)."""

    _fields_ = [("out", _P), ("q", _P), ("q_stride", _I), ("k_pool", _P), ("v_pool", _P), ("table", _P),
                ("table_stride", _I), ("rows", _P), ("kv_lens", _P), ("batch", _I), ("num_heads", _I),
                ("num_kv_heads", _I), ("head_dim", _I), ("scale", _F), ("window", _I), ("softcap", _F),
                ("k_new", _P), ("v_new", _P), ("k_stride", _I), ("v_stride", _I), ("out_locs", _P),
                ("kv_q8", ctypes.c_int32)]


def supported(device: str, dtype: torch.dtype) -> bool:
    """Whether the kernels take activations of `dtype` on `device` (float32 or bfloat16, on the CPU)."""
    return device == "cpu" and dtype in SUPPORTED_DTYPES


def require_supported(device: str, dtype: torch.dtype) -> None:
    """ValueError naming the torch backend, for the cpu attention backend asked for where it cannot run."""
    if not supported(device, dtype):
        raise ValueError(f"the cpu attention backend runs float32 or bfloat16 on the CPU; got {device} "
                         f"{str(dtype).removeprefix('torch.')} (use attention_backend='torch')")


def _check(t: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"{what}: expected a CPU {dtype} tensor, got {t.device} {t.dtype}")


class CpuKernels:
    """Typed entry points into the compiled library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._fns: dict[tuple[str, torch.dtype], Callable[..., None]] = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in SUPPORTED_DTYPES.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                self._fns[name, dtype] = fn
        self._quant: dict[str, Callable[..., object]] = {}
        for name, argtypes in _QUANT_SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int32 if name == "q_linear" else None
            self._quant[name] = fn
        self._q_linear = self._quant["q_linear"]
        lib.q_isa.restype = ctypes.c_int32
        lib.q_panel_bytes.argtypes, lib.q_panel_bytes.restype = [ctypes.c_int32, _I], _I
        self._panel_bytes = lib.q_panel_bytes
        lib.struct_bytes.argtypes, lib.struct_bytes.restype = [ctypes.c_char_p], _I
        self.check_struct("segment", _Segment)
        self.check_struct("attention_call", _Attention)
        self.check_struct("linear_call", _Linear)
        self.act_block_bytes = int(lib.struct_bytes(b"act_block"))
        self.isa = ("C", "AVX2", "AVX2+VNNI", "AVX-512+VNNI")[lib.q_isa()]
        """The instructions the quantized products run on here."""
        self.dense_rows = None if "VNNI" in self.isa else DENSE_ROWS
        """From how many rows a block-format product expands its weight for torch's GEMM (None: never)."""

    def check_struct(self, name: str, mirror: type[ctypes.Structure]) -> None:
        """KernelBuildError unless the ctypes `mirror` of C struct `name` has the C side's size (a field added on one
        side only)."""
        size = int(self.lib.struct_bytes(name.encode()))
        if size != ctypes.sizeof(mirror):
            raise KernelBuildError(f"the C struct {name} is {size} bytes, its ctypes mirror {mirror.__name__} "
                                   f"{ctypes.sizeof(mirror)}: the two sides disagree")

    def _fn(self, name: str, x: torch.Tensor) -> Callable[..., None]:
        """The entry point for x's dtype, after checking that x is a CPU tensor of a supported dtype."""
        if x.device.type != "cpu" or x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: expected a CPU float32 or bfloat16 tensor, got {x.device} {x.dtype}")
        return self._fns[name, x.dtype]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of x ([rows, dim], rows may be strided), rounded as transformers rounds."""
        _check(weight, x.dtype, "rms_norm weight")
        rows, dim = x.shape
        if x.stride(1) != 1 or not weight.is_contiguous():
            raise ValueError("rms_norm needs unit-stride rows and a contiguous weight")
        out = torch.empty((rows, dim), dtype=x.dtype)
        self._fn("rms_norm", x)(out.data_ptr(), x.data_ptr(), x.stride(0), weight.data_ptr(), rows, dim, eps)
        return out

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """Rotate x ([tokens, heads, head_dim], heads contiguous within a token) in place by each token's
        position; `cos` / `signed_sin` are [positions, head_dim] tables in x's dtype (see `apply_rope`)."""
        tokens, heads, dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != dim or not (cos.is_contiguous() and signed_sin.is_contiguous()):
            raise ValueError("rope_ needs heads contiguous within a token and contiguous tables")
        _check(cos, x.dtype, "rope cos table")
        _check(positions, torch.int64, "rope positions")
        self._fn("rope", x)(x.data_ptr(), tokens, heads, x.stride(0), positions.data_ptr(), cos.data_ptr(),
                                   signed_sin.data_ptr(), dim)

    def silu_mul(self, gate_up: torch.Tensor, model_dtype: torch.dtype, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """silu(gate) * up of a float32 gate/up GEMM output [rows, 2 * inter] as float32 [rows, inter],
        rounded where transformers' MLP in `model_dtype` rounds (for bf16: the GEMM output, SiLU, the
        product; for float32 nowhere extra). `out`, when given, receives it (a buffer the caller reuses)."""
        _check(gate_up, torch.float32, "silu_mul input")
        if not gate_up.is_contiguous():
            raise ValueError("silu_mul needs a contiguous [rows, 2 * inter] input")
        if model_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"silu_mul: model dtype must be float32 or bfloat16, got {model_dtype}")
        rows, width = gate_up.shape
        if out is None:
            out = torch.empty((rows, width // 2), dtype=torch.float32)
        elif out.shape != (rows, width // 2) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"silu_mul: out must be contiguous float32 {(rows, width // 2)}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        self._fns["silu_mul", model_dtype](out.data_ptr(), gate_up.data_ptr(), rows, width // 2)
        return out

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                        rows: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                        new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
        """softmax(q K^T * scale) V for each query token b over keys 0..kv_lens[b]-1 of the request whose
        positions sit in slots table[rows[b]] (a causal mask is a token's kv_lens; a sliding window, its last
        `window` keys only). q: [B, Hq, D]; caches: [locations, Hkv, D]. `new` = (k, v, out_locs): this step's keys
        and values ([B, Hkv, D], heads contiguous), written to their slots first. `softcap` caps each score as
        softcap * tanh(score / softcap)."""
        batch, num_heads, dim = q.shape
        num_kv_heads = k_cache.shape[1]
        if q.stride(2) != 1 or q.stride(1) != dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged_attention needs q's heads contiguous and contiguous caches")
        if table.stride(1) != 1 or not (rows.is_contiguous() and kv_lens.is_contiguous()):
            raise ValueError("paged_attention needs unit-stride table rows and contiguous rows / kv_lens")
        int8 = is_int8(k_cache)  # int8 rows with their scales (kernels/attention/int8_kv.py)
        if k_cache.shape[2] != (row_bytes(dim) if int8 else dim):
            raise ValueError(f"paged_attention: cache rows of {k_cache.shape[2]} for head_dim {dim}")
        for t, what in ((k_cache, "k cache"), (v_cache, "v cache")):
            _check(t, torch.int8 if int8 else q.dtype, what)
        for t, what in ((table, "request table"), (rows, "rows"), (kv_lens, "kv_lens")):
            _check(t, torch.int64, what)
        call = _Attention(q=q.data_ptr(), q_stride=q.stride(0), k_pool=k_cache.data_ptr(), v_pool=v_cache.data_ptr(),
                          table=table.data_ptr(), table_stride=table.stride(0), rows=rows.data_ptr(),
                          kv_lens=kv_lens.data_ptr(), batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=dim, scale=scale, window=window or 0, softcap=softcap or 0.0, kv_q8=int(int8))
        if new is not None:
            k, v, out_locs = new
            if k.shape != (batch, num_kv_heads, dim) or v.shape != k.shape or k.stride()[1:] != (dim, 1) or \
                    v.stride()[1:] != (dim, 1) or out_locs.numel() != batch:
                raise ValueError("paged_attention's new keys and values must be [tokens, kv heads, head dim] with "
                                 "heads contiguous, and a slot per token")
            _check(k, q.dtype, "new keys")
            _check(v, q.dtype, "new values")
            _check(out_locs, torch.int64, "out slots")
            out_locs = out_locs.contiguous()
            call.k_new, call.v_new, call.out_locs = k.data_ptr(), v.data_ptr(), out_locs.data_ptr()
            call.k_stride, call.v_stride = k.stride(0), v.stride(0)
        out = torch.empty((batch, num_heads, dim), dtype=q.dtype)
        call.out = out.data_ptr()
        self._fn("paged_attention", q)(ctypes.byref(call))
        return out

    def segments(self, w: BlockMatrix) -> ctypes.Array[_Segment]:
        """The C view of `w`'s segments, built once per matrix (it points into the segments' tensors)."""
        if w.handle is None:
            col, items = 0, []
            for seg in w.segments:
                if not seg.data.is_contiguous():
                    raise ValueError("a block matrix's segments must be contiguous")
                items.append(_Segment(seg.qtype.ggml_id, seg.data.data_ptr(), seg.rows, col))
                col += seg.rows
            w.handle = (_Segment * len(items))(*items)
        return w.handle  # type: ignore[return-value]

    def repack(self, rows: torch.Tensor, qtype: QType, columns: int) -> Segment:
        """File rows of a block format, or float32 / bfloat16 rows (ROW_TYPES), as uint8 [rows, row_bytes], in the
        kernels' panels of 8 rows (quant.c)."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1 or \
                rows.shape[1] != qtype.row_bytes(columns):
            raise ValueError(f"repack needs uint8 rows of {qtype.row_bytes(columns)} bytes ({columns} {qtype.name} "
                             f"values); got {tuple(rows.shape)} {rows.dtype}")
        panels = -(-rows.shape[0] // PANEL)
        out = torch.empty((panels, self._panel_bytes(qtype.ggml_id, columns)), dtype=torch.uint8)
        self._quant["q_repack"](out.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], columns,
                                qtype.ggml_id)
        return Segment(qtype, out, rows.shape[0])

    def expand(self, rows: torch.Tensor, qtype: QType, columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """File rows of a block format (uint8 [rows, row_bytes]) as int8 integers [rows, columns] and float32 scales
        and offsets per 16 values [rows, columns / 16]: the GPU kernels' form (kernels/quant.py,
        DeviceBlockWeight)."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1 or \
                rows.shape[1] != qtype.row_bytes(columns):
            raise ValueError(f"expand needs uint8 rows of {qtype.row_bytes(columns)} bytes ({columns} {qtype.name} "
                             f"values); got {tuple(rows.shape)} {rows.dtype}")
        n = rows.shape[0]
        q = torch.empty((n, columns), dtype=torch.int8)
        scale, offset = (torch.empty((n, columns // 16), dtype=torch.float32) for _ in range(2))
        self._quant["q_expand"](q.data_ptr(), scale.data_ptr(), offset.data_ptr(), rows.data_ptr(), rows.stride(0),
                                n, columns, qtype.ggml_id)
        return q, scale, offset

    def q_linear(self, x: torch.Tensor, w: BlockMatrix, bias: torch.Tensor | None = None,
                 add: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
                 gated: str | None = None, dense: torch.Tensor | None = None) -> torch.Tensor:
        """f(x) W^T (+ bias) (+ add) in float32, W in block formats, for a float32 x [rows, in] (unit-stride rows);
        f(x) is x, RMSNorm(x) with `norm` = (weight, eps), or with `gated` ("silu" or "gelu_tanh") act(gate) * up
        of x = [gate | up] ([rows, 2 in]). f(x) is quantized to ~15 bits per value on the way (quant.c); from
        `dense_rows` rows on (where that is not None), given a float32 buffer `dense` of at least out * in values,
        W is expanded into it instead and torch's GEMM multiplies (faster there without VNNI, and exact). The decode
        step calls this some hundred times a token, so the checks are few and cheap."""
        rows, width = x.shape
        k = w.in_features
        if x.dtype != torch.float32 or not x.is_cpu or x.stride(1) != 1 or width != (2 * k if gated else k) or \
                (norm is not None and gated) or gated not in GATED_INPUTS:
            raise ValueError(f"q_linear needs float32 unit-stride rows of {2 * k if gated else k} values (and "
                             f"one of norm, gated: silu or gelu_tanh); got {tuple(x.shape)} {x.dtype}, {gated!r}")
        n = w.out_features
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.numel() != n):
            raise ValueError(f"q_linear needs a contiguous float32 bias of {n}")
        if add is not None and (add.dtype != torch.float32 or add.shape != (rows, n) or add.stride(1) != 1):
            raise ValueError(f"q_linear adds a float32 [{rows}, {n}] tensor with unit-stride rows; got "
                             f"{tuple(add.shape)} {add.dtype}")
        weight = None
        if norm is not None:
            weight = norm[0]
            if weight.dtype != torch.float32 or not weight.is_contiguous() or weight.numel() != k:
                raise ValueError(f"q_linear needs a contiguous float32 norm weight of {k}")
        if dense is not None and self.dense_rows is not None and rows >= self.dense_rows:
            return self._dense_linear(x, w, bias, add, norm, gated, dense)
        out = torch.empty((rows, n), dtype=torch.float32)
        call = _Linear(out=out.data_ptr(), out_stride=n, x=x.data_ptr(), x_stride=x.stride(0), m=rows, k=k,
                       input=INPUT_RMS_NORM if norm else GATED_INPUTS[gated],
                       norm_weight=None if weight is None else weight.data_ptr(), eps=norm[1] if norm else 0.0,
                       segs=self.segments(w), nseg=len(w.segments), bias=None if bias is None else bias.data_ptr(),
                       add=None if add is None else add.data_ptr(), add_stride=0 if add is None else add.stride(0))
        status = self._q_linear(ctypes.byref(call))
        if status:
            raise MemoryError(f"q_linear: no memory for the quantized input of {rows} rows")
        return out

    def _dense_linear(self, x: torch.Tensor, w: BlockMatrix, bias: torch.Tensor | None, add: torch.Tensor | None,
                      norm: tuple[torch.Tensor, float] | None, gated: str | None, dense: torch.Tensor) -> torch.Tensor:
        """q_linear for many rows: f(x) in float32 by the C kernels, then W expanded into `dense` a chunk of rows at
        a time (whole panels), each chunk's columns of the output by torch's GEMM."""
        if norm is not None:
            x = self.rms_norm(x, norm[0], norm[1])
        elif gated == "silu":
            x = self.silu_mul(x.contiguous(), torch.float32)
        elif gated == "gelu_tanh":
            gate, up = x.chunk(2, dim=-1)
            x = torch.nn.functional.gelu(gate, approximate="tanh") * up
        n, k = w.shape
        chunk = max(PANEL, dense.numel() // k // PANEL * PANEL)
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            rows = self.dequantize_dense(w, dense, r0, r1)
            part = x @ rows.T if bias is None else torch.addmm(bias[r0:r1], x, rows.T)
            if r1 - r0 == n:  # one chunk: the product is the output
                out = part
            else:
                out[:, r0:r1] = part
        return out if add is None else out.add_(add)

    def dequantize_dense(self, w: BlockMatrix, buffer: torch.Tensor, start: int = 0, stop: int | None = None
                         ) -> torch.Tensor:
        """Rows [start, stop) of `w` (whole panels) as float32 [stop - start, in], written into the start of `buffer`
        (a contiguous float32 tensor, reused: a fresh allocation this size would cost page faults every call)."""
        n, k = w.shape
        stop = n if stop is None else stop
        if buffer.dtype != torch.float32 or not buffer.is_contiguous() or buffer.numel() < (stop - start) * k or \
                start % PANEL or (stop % PANEL and stop != n):
            raise ValueError(f"dequantize_dense needs a contiguous float32 buffer of {(stop - start) * k} values and "
                             f"rows on panel boundaries")
        self._quant["q_dequantize_dense"](buffer.data_ptr(), self.segments(w), len(w.segments), k, start, stop)
        return buffer.view(-1)[: (stop - start) * k].view(stop - start, k)

    def dequantize(self, seg: Segment, columns: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """A repacked segment's rows (`ids`: only those) as float32 [.., columns], equal bit for bit to gguf's
        dequantization of the file's rows."""
        if seg.data.shape[1] != self._panel_bytes(seg.qtype.ggml_id, columns):
            raise ValueError(f"dequantize: panels of {seg.data.shape[1]} bytes do not hold {columns} {seg.qtype.name} "
                             f"values")
        if ids is not None:
            _check(ids, torch.int64, "dequantize ids")
            ids = ids.contiguous()
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= seg.rows):
                raise ValueError(f"dequantize ids must be in [0, {seg.rows})")
        rows = seg.rows if ids is None else ids.numel()
        out = torch.empty((rows, columns), dtype=torch.float32)
        self._quant["q_dequantize"](out.data_ptr(), seg.data.data_ptr(), columns,
                                    None if ids is None else ids.data_ptr(), rows, seg.qtype.ggml_id)
        return out

    def quantize_activations(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, k] as the product sees it after quantizing it (quant.c's act_block: d * (q + r / 254) per
        block of 32), as float32 (for the tests)."""
        _check(x, torch.float32, "quantize_activations input")
        x = x.contiguous()
        rows, k = x.shape
        raw = torch.empty((rows * (k // 32), self.act_block_bytes), dtype=torch.uint8)
        self._quant["q_quantize_act"](raw.data_ptr(), x.data_ptr(), rows, k)
        d = raw[:, :4].contiguous().view(torch.float32)
        q = raw[:, 16:48].contiguous().view(torch.int8).float()
        r = raw[:, 48:80].contiguous().view(torch.int8).float()
        return (d * (q + r / 254.0)).reshape(rows, k)


@functools.cache
def _load() -> CpuKernels | KernelBuildError:
    """One build attempt per process: a failure is remembered, not retried at every call."""
    try:
        return CpuKernels(load_library(chosen_isa()))
    except KernelBuildError as e:
        return e


def load_cpu_kernels() -> CpuKernels:
    """The kernels, built on first use (on disk once per CPU and compiler); KernelBuildError if they cannot be."""
    loaded = _load()
    if isinstance(loaded, KernelBuildError):
        raise loaded
    return loaded


def cpu_kernels_available() -> bool:
    """Whether the kernels build and load here (no compiler: False, and the torch paths run instead)."""
    return not isinstance(_load(), KernelBuildError)


__all__ = ["SUPPORTED_DTYPES", "CpuKernels", "KernelBuildError", "cpu_kernels_available", "load_cpu_kernels",
           "require_supported", "supported"]
