"""Rules about the code itself that review would otherwise have to catch: the type checker is clean,
and imports only go down (kernels know nothing of the engine; clients know nothing of torch)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_type_checker_is_clean() -> None:
    """mypy over engine/, kernels/ and tui/ as pyproject.toml configures it."""
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_kernels_import_nothing_from_engine() -> None:
    offenders = []
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n == "engine" or n.startswith("engine.")]
    assert not offenders, offenders


def test_clients_import_no_torch() -> None:
    """The clients, the wire protocol and the engine's shared types start without torch (the console
    and the load generator would otherwise pay seconds of import)."""
    probe = ("import sys, engine, engine.service.client, engine.service.protocol, engine.outputs, engine.params; "
             "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)


def test_the_schedulers_decision_imports_no_model_kernel_or_tier_code() -> None:
    """engine/scheduler/policy.py decides who runs a step from the queues alone: importing it loads no torch,
    model, kernel or KV code (a reader finds the whole decision there, and nothing it could lean on)."""
    probe = ("import sys, engine.scheduler.policy; "
             "loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels') "
             "or m.startswith(('engine.model', 'engine.kv', 'engine.runner', 'engine.speculative'))]; "
             "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)
