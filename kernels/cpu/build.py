"""Compile minichat's C kernels for this CPU once, cache the shared library, and load it with ctypes.

No maintained library gives a torch-2.13 CPU paged attention or fused RMSNorm/RoPE (IPEX
pins older torch releases and is retired; vLLM and sgl-kernel ship theirs inside their own wheels), and
a torch C++ extension compiles against torch's headers for about a minute on two cores. These
kernels are plain C over raw pointers: `cc` builds them in about a second, with `-march=native` and
OpenMP (the process already holds torch's libgomp, which the library binds to, so both share one
thread pool). The library is cached under `cache_dir()` by a hash of the sources, flags, compiler and
CPU, so a second start only loads it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = {
    # -ffast-math: reassociated sums and vectorised expf (libmvec); attention has no bit-exact reference
    "attention.c": ["-ffast-math"],
    # no contraction into FMAs: RMSNorm and RoPE round after every operation, as transformers' eager ops do
    "elementwise.c": ["-ffp-contract=off", "-fno-math-errno"],
    # SiLU's expf is its own vectorisable one (activation.c): exact enough for transformers' bf16 roundings
    "activation.c": ["-ffp-contract=off", "-fno-math-errno"],
    # quantized products: explicit FMAs where wanted; dequantization's S * q + M is exact either way
    "quant.c": ["-ffp-contract=off", "-fno-math-errno"],
    # the fused decode step only orders the other files' functions
    "decode.c": ["-ffp-contract=off"],
}
COMMON_FLAGS = ["-O3", "-fPIC", "-fopenmp", "-std=gnu11"]
NATIVE = ("-march=native",)
"""The instruction set the library is built for: this CPU's. Tests also build older ones (`-march=haswell`:
AVX2 without VNNI; `-march=x86-64`: no AVX at all) to run every path of the quantized kernels here."""
LIBS = ["-lmvec", "-lm"]
ISA_ENV = "MINICHAT_CPU_ISA"
ISAS = {"native": NATIVE, "avx2": ("-march=haswell",), "baseline": ("-march=x86-64",)}
"""What $MINICHAT_CPU_ISA may force the kernels down to (x86): this CPU's own instructions (the default), AVX2 and
FMA without VNNI or AVX-512, or none of them (plain C): to compare paths, or to run where the CPU misreports."""


def chosen_isa() -> tuple[str, ...]:
    """The compiler flags $MINICHAT_CPU_ISA names (default: this CPU's); ValueError naming the choices otherwise."""
    name = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if name not in ISAS:
        raise ValueError(f"{ISA_ENV}={name!r}: expected one of {', '.join(ISAS)}")
    return ISAS[name]


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded here (no compiler, or it failed)."""


def cache_dir() -> Path:
    """$MINICHAT_CACHE_DIR, else $XDG_CACHE_HOME/minichat, else ~/.cache/minichat."""
    if os.environ.get("MINICHAT_CACHE_DIR"):
        return Path(os.environ["MINICHAT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minichat"


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise KernelBuildError(f"no C compiler ({cc!r} not found; set CC or install gcc)")
    return cc


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _library_key(cc: str, arch: tuple[str, ...]) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    for part in (version, _cpu_signature(), " ".join(COMMON_FLAGS + list(arch) + LIBS), repr(SOURCES)):
        digest.update(part.encode())
    for path in sorted(SOURCE_DIR.glob("*.[ch]")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _compile(cc: str, target: Path, arch: tuple[str, ...]) -> None:
    """Build every source into `target`, atomically (concurrent engines may build at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        objects = []
        for name, flags in SOURCES.items():
            obj = Path(tmp) / (name + ".o")
            _run([cc, *COMMON_FLAGS, *arch, *flags, "-I", str(SOURCE_DIR), "-c", str(SOURCE_DIR / name), "-o",
                  str(obj)])
            objects.append(str(obj))
        built = Path(tmp) / target.name
        _run([cc, "-shared", "-fopenmp", *objects, "-o", str(built), *LIBS])
        os.replace(built, target)


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise KernelBuildError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr.strip()[-2000:]}")


def load_library(arch: tuple[str, ...] = NATIVE) -> ctypes.CDLL:
    """The kernels' shared library for `arch` (compiler flags; default this CPU's), built first if this
    CPU, compiler and source have none cached. Import torch before calling, so that the library's OpenMP
    is torch's."""
    cc = _compiler()
    target = cache_dir() / f"cpu_kernels-{_library_key(cc, arch)}.so"
    if not target.is_file():
        log.info("building minichat's CPU kernels into %s (once per CPU and compiler)", target)
        start = time.perf_counter()
        try:
            _compile(cc, target, arch)
        except OSError as e:  # an unwritable cache directory, say: the torch paths run instead
            raise KernelBuildError(f"cannot build into {target.parent}: {e}") from e
        log.info("CPU kernels built in %.1f s", time.perf_counter() - start)
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelBuildError(f"cannot load {target}: {e}") from e
