"""Shared fixtures: tiny checkpoints made once per session, transformers as the oracle."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any @triton.jit
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that finish a parallel region sleep at once instead of spinning (before torch loads libgomp,
# here and in every engine the suite starts): the suite runs two workers with their engines on two cores, and a
# spinning team took the cycles the other worker's processes needed (a quarter of the suite's CPU time, measured
# on three heavy modules). The engine's own default, spinning, is tested where a test sets it (test_threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from engine.heap import freeze_loaded
from engine.service.client import EngineClient
from engine.service.launcher import EngineHandle
from kernels.cpu.build import cache_dir
from tests.checkpoints import LONG_CONTEXT, make_checkpoint, with_context
from tests.wire import raw_dealer

torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def frozen_imports() -> None:
    """What the worker imported before its first test (torch, transformers, textual, the engine: ~450,000 objects)
    lives as long as it does, so it leaves the cyclic collector's reach (engine/heap.py): a full collection then
    walks what the tests made, not the libraries too (with them, one took 0.37 s beside a busy process, and a test
    that loads a model runs several)."""
    freeze_loaded()

# The real model the tests download (tests/real_model.py) stays in the user's cache, once: 93 MB a run would be
# wasted. Everything else the suite writes goes into its own directories (`private_dirs`).
os.environ.setdefault("MINICHAT_TEST_MODELS", str(cache_dir() / "models"))


@pytest.fixture(scope="session", autouse=True)
def private_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's own runtime, cache and data directories: engine sockets and logs, the C kernels and
    converted GGUF metadata, conversations. A suite run used to leave dozens of engine logs and a converted
    directory per temporary GGUF file in ~/.cache/minichat (tests/test_private_dirs.py holds it to that)."""
    root = tmp_path_factory.mktemp("user")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(root / "run"))
        mp.setenv("MINICHAT_CACHE_DIR", str(_run_dir(tmp_path_factory) / "cache"))
        mp.setenv("MINICHAT_DATA_DIR", str(root / "data"))
        yield root


def _run_dir(factory: pytest.TempPathFactory) -> Path:
    """The run's own directory: under pytest-xdist, each worker's base directory is inside the run's, and what
    their engines build into the cache (C kernels, converted GGUF metadata; written atomically) one builds and the
    others load; a run without workers has one base directory."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="module", autouse=True)
def module_kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The KV disk tier's directory (engine/kv/disk.py) for the engines a module's fixtures start: pages one
    module cached must not serve the same prompts in another (each test gets its own again: `kv_dir`)."""
    path = tmp_path_factory.mktemp("kv")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINICHAT_KV_CACHE_DIR", str(path))
        yield path


@pytest.fixture(autouse=True)
def kv_dir(tmp_path_factory: pytest.TempPathFactory, module_kv_dir: Path) -> Iterator[Path]:
    """The KV disk tier's directory for the engines a test starts itself: a test finds on disk only what it
    wrote (a module's fixture engines keep the module's)."""
    path = tmp_path_factory.mktemp("kv")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINICHAT_KV_CACHE_DIR", str(path))
        yield path


class Checkpoints(dict[str, Path]):
    """The tiny checkpoint of each family (tests/checkpoints.py: FAMILIES), made on first use."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, family: str) -> Path:
        self[family] = make_checkpoint(family, self.root / family)
        return self[family]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def llama_ckpt(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def long_ckpt(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with a 64k context, so a request can stay running or mid-chunk until aborted
    (with 512 positions it would finish in well under a second on an idle machine; see UNTIL_ABORTED)."""
    return with_context(llama_ckpt, tmp_path_factory.mktemp("long") / "llama", LONG_CONTEXT)


NEAR_TIE = 1e-4
"""Top logits this close are a tie another CPU may break the other way: float32 logits of the tiny checkpoints
(magnitudes 1-10) differ by ~1e-6 between GEMM kernels; 1e-4 is 100 times that, and below any real preference."""


class HFOracle:
    """Greedy generation with transformers, one prompt at a time (no padding effects), memoised."""

    def __init__(self) -> None:
        self._models: dict[Path, torch.nn.Module] = {}
        self._memo: dict[tuple, list[int]] = {}

    def greedy(self, path: Path, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None) -> list[int]:
        key = (path, tuple(prompt), max_new_tokens, tuple(eos or ()))
        if key not in self._memo:
            model = self.model(path)
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=0)
            self._memo[key] = out[0, len(prompt):].tolist()
        return self._memo[key]

    def check_greedy(self, ours: list[int], path: Path, prompt: list[int], max_new_tokens: int,
                     eos: list[int] | None = None) -> None:
        """Assert that `ours` is transformers' greedy output, robustly: where it takes another token than
        transformers' `generate`, that is accepted only at a near-tie (transformers' own logit for its token at
        most NEAR_TIE above ours, in a full forward of the same prefix), and the reference continues from the
        token ours took. A tiny random checkpoint has such ties (2.9e-6 apart in one of the mistral tests), and
        another CPU's GEMM summation order flips them: an exact comparison there is a coin toss, not a test."""
        ref = self.greedy(path, prompt, max_new_tokens, eos)
        while ours != ref:
            j = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
            if j is None:
                raise AssertionError(f"lengths differ: ours {ours}, transformers {ref}")
            with torch.no_grad():
                logits = self.model(path)(torch.tensor([prompt + ours[:j]])).logits[0, -1].float()
            gap = float(logits[ref[j]] - logits[ours[j]])
            if gap > NEAR_TIE:
                raise AssertionError(f"token {j}: ours {ours[j]}, transformers {ref[j]} (whose logit is {gap:.3g} "
                                     f"higher: no near-tie); ours {ours}, transformers {ref}")
            taken = ours[: j + 1]
            ref = taken if eos and ours[j] in eos else \
                taken + self.greedy(path, prompt + taken, max_new_tokens - j - 1, eos)

    def model(self, path: Path) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if path not in self._models:  # a GGUF file: transformers dequantizes it to float32 with gguf's own code
            where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name) if path.suffix == ".gguf" \
                else dict(pretrained_model_name_or_path=path)
            self._models[path] = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
        return self._models[path]

    def log_softmax(self, path: Path, ids: list[int]) -> torch.Tensor:
        """Float32 log-probabilities [len(ids), vocab]: row i is the distribution of the token after ids[: i + 1]."""
        with torch.no_grad():
            return torch.log_softmax(self.model(path)(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="session")
def hf() -> HFOracle:
    return HFOracle()


# `ops` and `raw` serve the modules that define a `served` engine fixture (each with its own limits).
@pytest.fixture
def ops(served: EngineHandle) -> Iterator[EngineClient]:
    """A second client, the operator's: watches stats and aborts other clients' requests."""
    with served.client() as client:
        yield client


@pytest.fixture
def raw(served: EngineHandle) -> Iterator[zmq.Socket]:
    """A bare DEALER socket on the served engine, for frames no client library would send."""
    with raw_dealer(served.address) as sock:
        yield sock


# The console's tests (tests/test_tui*.py): conversations in a private directory, one engine per module.
@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the app keeps conversations: never the user's own data directory."""
    monkeypatch.setenv("MINICHAT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture(scope="module")
def engine(long_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An engine with four request slots on a private ipc address, for the module (a module with an
    `engine` fixture of its own overrides this one)."""
    from tests.test_tui import start_engine

    root = tmp_path_factory.mktemp("console")
    # a disk tier of its own: the one the run's engines share changes size as other workers' engines write, which
    # the KV pages panel shows (the idle console's test saw it redraw)
    with start_engine(long_ckpt, f"ipc://{root}/engine.sock", kv_cache_dir=str(root / "kv")):
        yield f"ipc://{root}/engine.sock"
