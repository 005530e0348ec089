"""The block-format kernels (kernels/cpu/quant.c) on every format and every instruction set this CPU can run:
this CPU's own build, AVX2 without VNNI (-march=haswell) and plain C (-march=x86-64), each built here.

Dequantization must equal gguf's bit for bit. The product cannot: x is quantized on the way. Its tolerance,
derived: each x value becomes d * (q + r / 254) with d = max|x| / 127 over its block of 32, q = round(x / d)
and r = round(254 (x / d - q)), so |x - x~| <= d / 508, plus the rounding of x / d itself in float32 (below
2^-24 * 128 of d, 0.4% of d / 508): |x - x~| <= 1.01 d / 508, and |x W^T - x~ W^T| <= sum over k of
|w_k| 1.01 d_k / 508. On top of that float32 accumulation: at most k / 32 + 16 additions of terms bounded
by |w| . |x|, each rounding by 2^-24 relative, so 1e-5 |w| . |x| covers it for these sizes with room.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf import dequantize

from kernels.cpu import CpuKernels, load_cpu_kernels
from kernels.cpu.build import ISA_ENV, NATIVE, chosen_isa, load_library
from kernels.cpu.hugepages import gather_into_huge_pages
from kernels.quant import BLOCK_TYPES, PANEL, QTYPES, BlockMatrix, DeviceBlockWeight
from tests.gguf_files import quantize_rows

X86 = platform.machine() in ("x86_64", "AMD64")
ARCHES = [NATIVE, *((("-march=haswell",), ("-march=x86-64",)) if X86 else ())]


@pytest.fixture(scope="module", params=ARCHES, ids=lambda a: a[0].removeprefix("-march="))
def kernels(request: pytest.FixtureRequest) -> CpuKernels:
    return CpuKernels(load_library(request.param))


def test_the_instruction_sets_are_what_they_say() -> None:
    if not X86:
        pytest.skip("the AVX2 builds are x86 only")
    assert CpuKernels(load_library(("-march=x86-64",))).isa == "C"
    assert CpuKernels(load_library(("-march=haswell",))).isa == "AVX2"
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = set(next(line for line in cpuinfo if line.startswith("flags")).split())
    # -march=native takes what the CPU has and the OS enables (gcc reads CPUID, and XGETBV for the AVX-512 state)
    expected = "AVX-512+VNNI" if {"avx512f", "avx512vl", "avx512_vnni"} <= flags else \
        "AVX2+VNNI" if "avx_vnni" in flags else "AVX2"
    assert load_cpu_kernels().isa == expected


def test_an_environment_variable_forces_a_lower_instruction_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """$MINICHAT_CPU_ISA picks the build the engine loads (kernels.cpu.load_cpu_kernels builds `chosen_isa()`)."""
    if not X86:
        pytest.skip("the AVX2 builds are x86 only")
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert CpuKernels(load_library(chosen_isa())).isa == "AVX2"
    monkeypatch.setenv(ISA_ENV, "baseline")
    assert CpuKernels(load_library(chosen_isa())).isa == "C"
    monkeypatch.setenv(ISA_ENV, "avx9")
    with pytest.raises(ValueError, match="MINICHAT_CPU_ISA='avx9': expected one of native, avx2, baseline"):
        chosen_isa()


def file_rows(qtype: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random weights in `qtype`'s file layout; scales of both signs, outlier rows, a zero row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, columns)).astype(np.float32) * rng.uniform(0.01, 2.0, (rows, 1)).astype(np.float32)
    x[1] *= 40.0
    x[2] = 0.0
    return quantize_rows(x, qtype)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("rows,columns", [(37, 256), (8, 512), (19, 768)])
def test_dequantize_equals_gguf_bit_for_bit(kernels: CpuKernels, qtype: str, rows: int, columns: int) -> None:
    raw = file_rows(qtype, rows, columns, seed=rows + columns)
    reference = dequantize(raw, G[qtype])
    seg = kernels.repack(torch.from_numpy(raw), QTYPES[qtype], columns)
    assert seg.rows == rows and seg.data.shape[0] == -(-rows // PANEL)
    ours = kernels.dequantize(seg, columns).numpy()
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))  # -0.0 and NaN bits included
    ids = torch.tensor([rows - 1, 0, 7, 1, 7], dtype=torch.int64)
    picked = kernels.dequantize(seg, columns, ids).numpy()
    assert np.array_equal(picked.view(np.uint32), reference[ids.numpy()].view(np.uint32))


def tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The bound derived in the module docstring, per output element."""
    d = x.abs().reshape(x.shape[0], -1, 32).amax(-1) / 127
    step = (1.01 * d / 508).repeat_interleave(32, dim=1)
    return (step.double() @ w.abs().double().T) + 1e-5 * (x.abs().double() @ w.abs().double().T)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_product_is_within_the_derived_bound(kernels: CpuKernels, qtype: str, m: int) -> None:
    rows, columns = 45, 512
    raw = file_rows(qtype, rows, columns, seed=m)
    w = torch.from_numpy(dequantize(raw, G[qtype]))
    matrix = BlockMatrix(columns, [kernels.repack(torch.from_numpy(raw), QTYPES[qtype], columns)])
    x = torch.randn(m, columns, generator=torch.Generator().manual_seed(m))
    x[0, 5] = 300.0  # an outlier in one block, as real activations have
    y = kernels.q_linear(x, matrix)
    exact = x.double() @ w.double().T
    assert ((y.double() - exact).abs() <= tolerance(x, w)).all()
    # the activations as the product saw them are within the bound the tolerance assumes
    seen = kernels.quantize_activations(x)
    block_max = x.abs().reshape(m, -1, 32).amax(-1, keepdim=True).expand(m, -1, 32).reshape(m, columns)
    assert ((seen - x).abs() <= 1.01 * block_max / 127 / 508).all()


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_each_row_of_a_product_is_what_it_gives_alone(kernels: CpuKernels, qtype: str) -> None:
    """Rows of x that share a pass over a tile (with AVX-512 VNNI, two panels' tiles in one 512-bit vector, where a
    row alone reads one panel at a time) give bit for bit what each gives alone: a request's numbers do not depend
    on its batch. 21 rows: a pair of panels and a panel on its own."""
    rows, columns, m = 21, 512, 9
    raw = file_rows(qtype, rows, columns, seed=5)
    matrix = BlockMatrix(columns, [kernels.repack(torch.from_numpy(raw), QTYPES[qtype], columns)])
    x = torch.randn(m, columns, generator=torch.Generator().manual_seed(3))
    together = kernels.q_linear(x, matrix)
    alone = torch.cat([kernels.q_linear(x[i : i + 1], matrix) for i in range(m)])
    assert torch.equal(together, alone)


def test_weights_gathered_into_huge_pages_multiply_as_before(kernels: CpuKernels) -> None:
    """The loader moves a model's repacked segments into one 2 MiB-aligned buffer advised as huge pages: products
    are bit for bit what they were, a segment two matrices share (a tied head) moves once, a view into a larger
    tensor (a tensor-parallel slice) stays, and every moved segment starts on a cache line."""
    columns = 256

    def segment(qtype: str, rows: int, seed: int):
        return kernels.repack(torch.from_numpy(file_rows(qtype, rows, columns, seed=seed)), QTYPES[qtype], columns)

    first = BlockMatrix(columns, [segment("Q4_K", 16, 1), segment("Q8_0", 13, 2)])
    second = BlockMatrix(columns, [segment("Q4_0", 24, 3)])
    tied = BlockMatrix(columns, [first.segments[0]])
    big = BlockMatrix(columns, [segment("Q6_K", 40, 4)])
    view = big.rows_of(8, 16)
    x = torch.randn(3, columns, generator=torch.Generator().manual_seed(0))
    before = [kernels.q_linear(x, m) for m in (first, second, tied, view)]
    view_at = view.segments[0].data.data_ptr()
    moved = gather_into_huge_pages([first, second, tied, view])
    assert moved == sum(-(-s.nbytes // 64) * 64 for s in (*first.segments, *second.segments))
    base = first.segments[0].data.data_ptr()
    assert base % (2 << 20) == 0 and tied.segments[0] is first.segments[0]
    for seg in (*first.segments, *second.segments):
        assert base <= seg.data.data_ptr() < base + moved and seg.data.data_ptr() % 64 == 0
    assert view.segments[0].data.data_ptr() == view_at
    after = [kernels.q_linear(x, m) for m in (first, second, tied, view)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_mixed_segments_bias_and_residual(kernels: CpuKernels) -> None:
    """A fused weight whose parts came in different formats (a Q4_K_M file's q/k/v), a float part, a bias and a
    residual added as the output is written."""
    columns, parts = 256, [("Q4_K", 16), ("Q6_K", 13), ("Q8_0", 8)]
    segments, dense = [], []
    for i, (qtype, rows) in enumerate(parts):
        raw = file_rows(qtype, rows, columns, seed=i)
        segments.append(kernels.repack(torch.from_numpy(raw), QTYPES[qtype], columns))
        dense.append(torch.from_numpy(dequantize(raw, G[qtype])))
    f32 = torch.randn(5, columns)
    segments.append(kernels.repack(f32.contiguous().view(torch.uint8), QTYPES["F32"], columns))
    dense.append(f32)
    matrix = BlockMatrix.join(columns, segments)
    w = torch.cat(dense)
    assert matrix.shape == (42, columns) and matrix.formats == ["Q4_K", "Q6_K", "Q8_0", "F32"]
    x, bias, residual = torch.randn(6, columns), torch.randn(42), torch.randn(6, 42)
    y = kernels.q_linear(x, matrix, bias=bias, add=residual)
    exact = x.double() @ w.double().T + bias.double() + residual.double()
    assert ((y.double() - exact).abs() <= tolerance(x, w) + 1e-6).all()


@pytest.mark.parametrize("gated", ["silu", "gelu_tanh"])
def test_the_gated_input_is_torchs_activation_times_up(kernels: CpuKernels, gated: str) -> None:
    """`gated`: the product takes act(gate) * up of x = [gate | up], act computed in C (SiLU; GELU's tanh form for
    Gemma, tanh by exp): within the product's bound of torch's activation, plus the activation's own rounding (a
    few float32 ulps of each input value: 1e-6 of |act(gate) * up| covers it)."""
    columns, rows = 256, 24
    raw = file_rows("Q8_0", rows, columns, seed=4)
    w = torch.from_numpy(dequantize(raw, G["Q8_0"]))
    matrix = BlockMatrix(columns, [kernels.repack(torch.from_numpy(raw), QTYPES["Q8_0"], columns)])
    x = 4 * torch.randn(5, 2 * columns, generator=torch.Generator().manual_seed(5))
    gate, up = x.double().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) if gated == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
    inner = (act * up).float()
    exact = inner.double() @ w.double().T
    bound = tolerance(inner, w) + 1e-6 * (inner.abs().double() @ w.abs().double().T)
    assert ((kernels.q_linear(x, matrix, gated=gated).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_float_rows_multiply_exactly_in_float32_and_read_back(kernels: CpuKernels, m: int) -> None:
    """Float32 and bfloat16 rows in panels (a float model's kept rows, kernels/quant.py ROW_TYPES): x is not
    quantized and a bfloat16 weight widens exactly, so the product is float32 arithmetic on the very values, off the
    exact one by float32 summation alone (k additions of terms bounded by |w| . |x|: 1e-6 of that covers 100
    columns). 100 columns leave a part-chunk past the last 16; 13 rows a part-filled panel. Rows read back as they
    are, by id too."""
    columns, rows = 100, 13
    w = torch.randn(rows, columns, generator=torch.Generator().manual_seed(m))
    x = torch.randn(m, columns, generator=torch.Generator().manual_seed(m + 1))
    for qtype, dtype in (("F32", torch.float32), ("BF16", torch.bfloat16)):
        values = w.to(dtype)
        matrix = BlockMatrix(columns, [kernels.repack(values.contiguous().view(torch.uint8), QTYPES[qtype], columns)])
        exact = x.double() @ values.double().T
        bound = 1e-6 * (x.abs().double() @ values.abs().double().T)
        assert ((kernels.q_linear(x, matrix).double() - exact).abs() <= bound).all(), qtype
        assert torch.equal(kernels.dequantize(matrix.segments[0], columns), values.float())
        picked = kernels.dequantize(matrix.segments[0], columns, torch.tensor([12, 0]))
        assert torch.equal(picked, values[[12, 0]].float())
        buffer = torch.empty(rows * columns)
        assert torch.equal(kernels.dequantize_dense(matrix, buffer), values.float())


def test_join_merges_only_whole_panels() -> None:
    kernels = load_cpu_kernels()
    raw = [file_rows("Q8_0", rows, 64, seed=rows) for rows in (16, 8, 5, 3)]
    segs = [kernels.repack(torch.from_numpy(r), QTYPES["Q8_0"], 64) for r in raw]
    joined = BlockMatrix.join(64, segs)
    assert [s.rows for s in joined.segments] == [29, 3]  # 16 + 8 + 5 merge; the 5 leaves a part-filled panel
    full = torch.from_numpy(dequantize(np.concatenate(raw), G.Q8_0))
    assert torch.equal(torch.cat([kernels.dequantize(s, 64) for s in joined.segments]), full)
    assert torch.equal(kernels.dequantize(joined.rows_of(8, 16).segments[0], 64), full[8:24])
    with pytest.raises(ValueError, match="panels"):
        joined.rows_of(4, 8)


def test_bad_shapes_are_refused() -> None:
    kernels = load_cpu_kernels()
    raw = torch.from_numpy(file_rows("Q4_K", 8, 256, seed=0))
    with pytest.raises(ValueError, match="rows of 144 bytes"):
        kernels.repack(raw[:, :100], QTYPES["Q4_K"], 256)
    matrix = BlockMatrix(256, [kernels.repack(raw, QTYPES["Q4_K"], 256)])
    with pytest.raises(ValueError, match="unit-stride rows of 256"):
        kernels.q_linear(torch.randn(2, 128), matrix)
    with pytest.raises(ValueError, match="ids must be in"):
        kernels.dequantize(matrix.segments[0], 256, torch.tensor([8]))


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_the_gpu_form_is_the_files_values(qtype: str) -> None:
    """The GPU kernels' int8 + scale/offset form (kernels/quant.py, DeviceBlockWeight) holds every format
    exactly: scale * q + offset equals gguf's dequantization (as values: gguf's S * (q - 8) can be -0.0)."""
    raw = file_rows(qtype, 11, 512, seed=5)
    weight = DeviceBlockWeight(*load_cpu_kernels().expand(torch.from_numpy(raw), QTYPES[qtype], 512), [qtype])
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(raw, G[qtype])))
    assert torch.equal(weight.dequantize(torch.tensor([3, 0])), weight.dequantize()[[3, 0]])


@pytest.mark.parametrize("m,n", [(1, 45), (5, 64), (33, 70)])
def test_triton_weight_only_product(m: int, n: int) -> None:
    """The Triton kernel under the interpreter: the product of x with the dequantized weights, in float32
    (ieee dots), within float32 accumulation of the exact product (k / 64 tiles of 64-term dots)."""
    from kernels.triton.quant import weight_only_linear

    k = 256
    raws = [file_rows(qtype, n, k, seed=n) for qtype in ("Q4_K", "Q8_0")]
    parts = [load_cpu_kernels().expand(torch.from_numpy(r), QTYPES[t], k) for r, t in zip(raws, ("Q4_K", "Q8_0"),
                                                                                          strict=True)]
    weight = DeviceBlockWeight(*(torch.cat([p[i] for p in parts]) for i in range(3)), ["Q4_K", "Q8_0"])
    dense = weight.dequantize()
    x, bias = torch.randn(m, k), torch.randn(2 * n)
    y = weight_only_linear(x, weight, bias)
    exact = x.double() @ dense.double().T + bias.double()
    assert ((y.double() - exact).abs() <= 1e-5 * (x.abs().double() @ dense.abs().double().T + 1)).all()
