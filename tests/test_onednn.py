"""oneDNN's primitive caches are bounded in the engine's process (engine/onednn.py), unless the user chose."""

from __future__ import annotations

from pathlib import Path

from engine.onednn import CACHE_ENV, CAPACITY, cache_capacities, prepare_onednn
from engine.service.launcher import start


def test_the_caches_are_ours_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    prepare_onednn(env)
    assert env == dict.fromkeys(CACHE_ENV, CAPACITY)
    for chosen in ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}, {"LRU_CACHE_CAPACITY": "8"}):
        env = dict(chosen)
        prepare_onednn(env)
        assert env == chosen


def test_a_served_engine_runs_with_bounded_caches(llama_ckpt: Path, tmp_path: Path) -> None:
    """The engine process's own environment, as its info reports it (set before torch loaded oneDNN)."""
    handle = start(f"ipc://{tmp_path}/engine.sock", model=str(llama_ckpt))
    try:
        with handle.client() as client:
            assert client.info().execution["onednn_caches"] == cache_capacities(dict.fromkeys(CACHE_ENV, CAPACITY))
    finally:
        handle.stop()
