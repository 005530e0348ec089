"""scripts/gpu_profile.py and scripts/gpu_check.sh, checked where they can be: on a CPU.

The GPU machine is reached rarely and only through gpu_check.sh, so whatever can fail before the
first kernel runs must fail here: the profile's driving of the scheduler, its report's shape, the
kernel-name families (CUDA names included, as strings), and the check script's steps and time budget.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "scripts" / "gpu_profile.py"
CHECK = ROOT / "scripts" / "gpu_check.sh"


@functools.cache
def load_profile_module() -> ModuleType:
    """The script as a module (it is not in a package); registered first, as its dataclasses need."""
    spec = importlib.util.spec_from_file_location("gpu_profile", PROFILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """The demo model profiled at batch 1 and 2 on one thread (one thread: steady on a shared machine), layer by
    layer: in one C call a step (the demo model's float32 rows kept) its families would be one `layers` span."""
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    run = subprocess.run([sys.executable, str(PROFILE), "--device", "cpu", "--batches", "1,2", "--prompt-len", "8",
                          "--steps", "2", "--warmup-steps", "1", "--threads", "1", "--no-one-call", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def test_cpu_profile_counts_every_step(cpu_report: tuple[dict, str]) -> None:
    report, _ = cpu_report
    families = report["families"]
    assert {"gemm", "attention", "norm", "rope", "activation", "sampling", "copy/index", "other"} <= set(families)
    assert report["device"] == "cpu" and report["batches"] == [1, 2]
    rows = {(r["batch"], r["kind"]): r for r in report["rows"]}
    assert set(rows) == {(1, "prefill"), (1, "decode"), (2, "prefill"), (2, "decode")}
    for (batch, kind), row in rows.items():
        assert row["requests"] == batch
        assert row["tokens"] == batch * (8 if kind == "prefill" else 1)
        assert row["steps"] == (1 if kind == "prefill" else 2)
        for key in ("kernels", "host_ops", "busy_ms", "wall_ms", "forward_ms", "schedule_ms", "process_ms"):
            assert row[key] > 0, (batch, kind, key, row[key])
        assert row["memcpy"] is None  # no device copies on a CPU
        assert set(row["family_ms"]) == set(families)
        # the model's work is all there: its GEMMs, attention, norms, RoPE and MLP activation, and a sampler
        for fam in ("gemm", "attention", "norm", "rope", "activation", "sampling"):
            assert row["family_ms"][fam] > 0, (batch, kind, fam)
        # on a CPU every counted op's time goes to exactly one family
        assert sum(row["family_ms"].values()) == pytest.approx(row["busy_ms"], rel=1e-6)
        assert row["top"] and row["top"][0]["ms_per_step"] > 0


def test_cpu_profile_prints_tables(cpu_report: tuple[dict, str]) -> None:
    _, stdout = cpu_report
    assert "time per kernel family" in stdout
    header = next(line for line in stdout.splitlines() if line.startswith("batch"))
    for column in ("kernels", "busy ms", "gap ms", "sched ms", "sample ms", "process ms"):
        assert column in header
    assert "top kernels, batch 2 decode" in stdout


@pytest.mark.parametrize(("name", "expected"), [
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<float>, "
     "unsigned int, long, 4, 4> >(at::native::ReduceOp<...>)", "sampling"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NTT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off", "gemm"),
    ("std::enable_if<!T7, void>::type internal::gemvx::kernel<int, int, __nv_bfloat16>(...)", "gemm"),
    ("_decode_grouped_stage1", "attention"),
    ("_extend_kernel", "attention"),
    ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>", "attention"),
    ("_store_kv_kernel", "copy/index"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>",
     "copy/index"),
    ("void at::native::index_elementwise_kernel<128, 4, ...>", "copy/index"),
    ("Memcpy HtoD (Pageable -> Device)", "copy/index"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ...>",
     "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)...>",
     "activation"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>",
     "norm"),
    ("void at::native::(anonymous namespace)::roll_cuda_kernel<c10::BFloat16>(...)", "rope"),
    ("mkldnn::_linear_pointwise", "gemm"),
    ("cpu_kernel::paged_attention", "attention"),
    ("cpu_kernel::rms_norm", "norm"),
    ("cpu_kernel::rope_", "rope"),
    ("cpu_kernel::silu_mul", "activation"),
    ("aten::argmax", "sampling"),
    ("aten::max", "sampling"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, "
     "float, 4>>(...)", "sampling"),
    ("aten::index_copy_", "copy/index"),
    ("aten::slice", "other"),
])
def test_kernel_families(name: str, expected: str) -> None:
    assert load_profile_module().family(name) == expected


def fake_event(name: str, start: float, end: float, kind: str, parent: object = None, cuda: bool = False,
               typed: bool = True) -> SimpleNamespace:
    """A profiler event as torch's FunctionEvent shows it (times in us); `typed=False` leaves out the
    activity type, as older torch releases do."""
    from torch.autograd import DeviceType

    event = SimpleNamespace(name=name, device_type=DeviceType.CUDA if cuda else DeviceType.CPU, cpu_parent=parent,
                            time_range=SimpleNamespace(start=start, end=end), is_async=False,
                            is_user_annotation=kind == "user_annotation")
    if typed:
        event.activity_type = kind
    return event


@pytest.mark.parametrize("typed", [True, False], ids=["activity-type", "names-only"])
def test_cuda_profile_is_split_into_steps_by_time(typed: bool) -> None:
    """What kineto reports for a graphed decode step, built by hand: kernels of a graph replay have no
    launching op, so they are assigned to steps by time; runtime calls are not ops; the device's
    mirror of a range is not a kernel; overlapping kernels count once in busy time."""
    gp = load_profile_module()

    def ev(name: str, start: float, end: float, kind: str, parent: object = None, cuda: bool = False):
        return fake_event(name, start, end, kind, parent, cuda, typed)

    first = ev("minichat.step/b2/decode", 0, 100, "user_annotation")
    index = ev("aten::index_select", 5, 10, "cpu_op", first)
    argmax = ev("aten::argmax", 30, 35, "cpu_op", first)
    skipped = ev("minichat.step/other", 200, 300, "user_annotation")
    second = ev("minichat.step/b2/decode", 400, 500, "user_annotation")
    events = [
        first, index, ev("cudaLaunchKernel", 6, 7, "cuda_runtime", index), argmax,
        ev("cudaGraphLaunch", 20, 22, "cuda_runtime", first),
        ev("void at::native::index_elementwise_kernel<128, 4>", 12, 14, "kernel", cuda=True),
        ev("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 25, 40, "kernel", cuda=True),
        ev("_decode_grouped_stage1", 40, 50, "kernel", cuda=True),
        ev("void at::native::reduce_kernel<ArgMaxOps<float>>", 45, 47, "kernel", cuda=True),
        ev("Memcpy DtoH (Device -> Pinned)", 60, 61, "gpu_memcpy", cuda=True),
        ev("minichat.step/b2/decode", 12, 61, "gpu_user_annotation", cuda=True),
        skipped, ev("_decode_grouped_stage1", 210, 220, "kernel", cuda=True),
        ev("_decode_grouped_stage1", 150, 160, "kernel", cuda=True),  # between steps: nobody's
        second, ev("_decode_grouped_stage1", 410, 415, "kernel", cuda=True),
    ]
    steps = gp.analyse(SimpleNamespace(events=lambda: events), "cuda")
    assert set(steps) == {"b2/decode"}
    one, two = steps["b2/decode"]
    assert (one.kernels, one.copies, one.host_ops) == (4, 1, 2)
    assert one.busy_us == pytest.approx(2 + 15 + 10 + 1)  # the argmax runs inside the attention's span
    fam = one.family_us
    assert (fam["copy/index"], fam["gemm"], fam["attention"], fam["sampling"]) == (3, 15, 10, 2)
    assert (two.kernels, two.copies, two.host_ops, two.busy_us) == (1, 0, 0, 5)


@pytest.mark.parametrize("flashinfer", ["", "1"], ids=["triton", "flashinfer"])
def test_gpu_check_dry_run_lists_the_sweep_and_the_profile(flashinfer: str) -> None:
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_FLASHINFER": flashinfer, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(CHECK)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    commands = [line[2:] for line in run.stdout.splitlines() if line.startswith("+ ")]

    def timeout(cmd: str) -> int:
        match = re.match(r"timeout (\d+) ", cmd)
        assert match, f"no timeout: {cmd}"
        return int(match.group(1))

    sweep = [c for c in commands if " bench --address " in c]
    levels = {int(re.search(r"--concurrency (\d+)", c).group(1)): c for c in sweep}  # type: ignore[union-attr]
    assert sorted(levels) == [1, 8, 32, 128]
    assert sum(int(re.search(r"--num-requests (\d+)", c).group(1)) for c in sweep) >= 1000  # type: ignore[union-attr]
    serve = next(c for c in commands if " serve " in c)
    start = int(re.search(r"wait up to (\d+) s", run.stdout).group(1))  # type: ignore[union-attr]
    assert timeout(serve) >= start + sum(timeout(c) for c in sweep)  # the engine outlives every level
    profile = next(c for c in commands if "scripts/gpu_profile.py" in c)
    assert "--batches 1,32,128" in profile and "--device cuda" in profile
    # Every step that runs is bounded, and on one GPU (no TP step) the bounds add up to at most ten
    # minutes; the sweep's levels run inside its engine's lifetime.
    bounded = [c for c in commands if c.startswith("timeout ") and c not in sweep]
    assert any("pytest" in c for c in bounded) and any("bench_offline.py" in c for c in bounded)
    assert sum(timeout(c) for c in bounded) <= 600
    untimed = [c for c in commands if not c.startswith(("timeout ", "wait ")) and ("bench" in c or ".py" in c)]
    assert all("make_random_checkpoint.py" in c or " stop " in c for c in untimed), untimed
