"""Which engine answers a request: the one engine of `serve --http --model PATH` (`OneModel`), or, for a catalogue
(`--models-dir`, `--model NAME=PATH`), the named model's own engine, started on its first request and stopped when
it has been idle for its keep-alive or when another model needs its place (`ModelRouter`).

Each loaded model is a `minichat serve` process of its own, started by the launcher at a private ipc address, with
its own client and `ApiState`: the routes do not know whether there is one engine or several. A route holds a
`Lease` on its model for as long as its response runs (a stream until its last event), and a model with leases
out is never unloaded. Loads and unloads happen one at a time (one lock); a request for a model that is loaded
takes no lock at all, so a load never stalls the other models' streams here (their engines are other processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine.service.catalogue import Catalogue, Entry, engine_address
from engine.service.client import AsyncEngineClient
from engine.service.http.errors import ApiError
from engine.service.http.metrics import Metrics
from engine.service.http.state import ApiState
from engine.service.launcher import EngineHandle, EngineStartError
from engine.service.options import ApiOptions

log = logging.getLogger("minichat.http")

GIB = 1 << 30
StartEngine = Callable[[Entry, str, bool], EngineHandle]
"""Starts `minichat serve` on an entry at an address and waits until it answers (the launcher's `start`, with the
server's engine options; the flag: other engines run, so it loads in the background: `--background-load`);
EngineStartError when it cannot."""


@dataclass
class Lease:
    """A route's hold on its model's engine: the model is not unloaded before `release()`."""

    state: ApiState
    release: Callable[[], None] = lambda: None


class Models(Protocol):
    """What the routes ask for a request's engine."""

    async def lease(self, model: str | None, keep_alive: float | None = None) -> Lease: ...


class OneModel:
    """`serve --http --model PATH` and `minichat api`: one engine, whatever its lifetime; `keep_alive` means nothing
    here and is refused rather than ignored."""

    def __init__(self, state: ApiState) -> None:
        self.state = state

    async def lease(self, model: str | None, keep_alive: float | None = None) -> Lease:
        if keep_alive is not None:
            raise ApiError(400, "keep_alive: this server runs one engine for its whole life; keep_alive applies to "
                                "a server of several models (--models-dir or --model NAME=PATH)", param="keep_alive")
        return Lease(self.state)


@dataclass(frozen=True)
class Limits:
    """When loaded models make room: more than `max_loaded`, or weights and KV pools over `memory_bytes`; and how
    long an idle model stays loaded by default (`keep_alive` seconds; 0: unloaded after each reply; < 0: never)."""

    max_loaded: int = 3
    memory_bytes: int | None = None
    keep_alive: float = 300.0
    dtype: str = "float32"  # --dtype: what a checkpoint's weights widen to in memory
    kv_bytes: int = 0  # --kv-memory-gb when given: each engine's KV pool before it reports its own


@dataclass(eq=False)
class Loaded:
    """A model whose engine runs."""

    entry: Entry
    handle: EngineHandle
    state: ApiState
    watcher: asyncio.Task[None]
    load_seconds: float
    keep_alive: float
    weight_bytes: int
    kv_guess: int
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    expiry: asyncio.TimerHandle | None = None

    def alive(self) -> bool:
        """Its engine runs: not exited, and not exiting (a killed process's leader is a zombie while its other
        threads still exit, and only then can it be reaped: requests sent meanwhile would meet a closed socket)."""
        process = self.handle.process
        return process is None or (process.poll() is None and not _exiting(process.pid))

    def memory(self) -> int:
        """Weights plus the KV pool: the pool's real size once the engine has published its stats."""
        stats = self.state.metrics.engine.stats
        kv = stats.pages.total * stats.pages.page_bytes if stats is not None and stats.pages.page_bytes else 0
        return self.weight_bytes + (kv or self.kv_guess)

    def idle_seconds(self) -> float:
        return 0.0 if self.in_flight else time.monotonic() - self.last_used

    def expires_in(self) -> float | None:
        if self.in_flight or self.keep_alive < 0:
            return None
        return max(0.0, self.keep_alive - self.idle_seconds())


class ModelRouter:
    """A catalogue's models, each loaded on demand as its own engine and unloaded by keep-alive and by LRU."""

    def __init__(self, catalogue: Catalogue, options: ApiOptions, start: StartEngine, limits: Limits) -> None:
        self.catalogue, self.options, self.start, self.limits = catalogue, options, start, limits
        self.loaded: dict[str, Loaded] = {}
        self.loads = dict.fromkeys(catalogue.ids(), 0)
        self.unloads = dict.fromkeys(catalogue.ids(), 0)
        self._failed: dict[str, tuple[tuple[float, int], str]] = {}  # id -> (the file's mtime and size, why)
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.created = int(time.time())

    # --- what the routes call -------------------------------------------------------------------------------------

    async def lease(self, model: str | None, keep_alive: float | None = None) -> Lease:
        """The model's engine, loaded first if need be, held until the lease is released."""
        loaded = await self.ensure(self.entry(model))
        loaded.in_flight += 1
        if loaded.expiry is not None:
            loaded.expiry.cancel()
            loaded.expiry = None
        if keep_alive is not None:
            loaded.keep_alive = keep_alive
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(loaded)

        return Lease(loaded.state, release)

    def entry(self, model: str | None) -> Entry:
        """The catalogue's entry for `model`: 400 without one, 404 naming the ids for an unknown one."""
        if model is None:
            raise ApiError(400, f"model: required: this server serves several models ({self._ids()})",
                           param="model")
        if model not in self.catalogue:
            raise ApiError(404, f"The model `{model[:200]}` does not exist; this server serves {self._ids()}.",
                           param="model", code="model_not_found")
        return self.catalogue[model]

    async def ensure(self, entry: Entry) -> Loaded:
        """`entry` loaded (an engine that died is started again); concurrent first requests start it once."""
        loaded = self.loaded.get(entry.id)
        if loaded is not None and loaded.alive():
            return loaded
        async with self._lock:
            loaded = self.loaded.get(entry.id)
            if loaded is not None and loaded.alive():
                return loaded
            if loaded is not None:
                log.warning("model %s: its engine (pid %d) exited; starting it again", entry.id, loaded.handle.pid)
                await self._unload(loaded)
            self._refuse_if_failed(entry)
            weights = entry.weight_bytes(self.limits.dtype)
            need = weights + self.limits.kv_bytes
            budget = self.limits.memory_bytes
            if budget is not None and need > budget:
                raise self._failure(entry, f"it needs about {need / GIB:.2f} GiB (weights and KV pool), more than "
                                           f"--models-memory-gib {budget / GIB:g}")
            await self._make_room(entry, need)
            return await self._load(entry, weights)

    async def unload(self, model: str) -> bool:
        """Unload `model` now (False if it was not loaded); 409 while it has requests in flight."""
        entry = self.entry(model)
        async with self._lock:
            loaded = self.loaded.get(entry.id)
            if loaded is None:
                return False
            if loaded.in_flight:
                raise ApiError(409, f"model {entry.id} has {loaded.in_flight} request(s) in flight; unload it when "
                                    f"they are done", code="model_busy")
            await self._unload(loaded)
            return True

    async def close(self) -> None:
        """Stop every engine (the server is stopping)."""
        for task in list(self._tasks):
            task.cancel()
        async with self._lock:
            for loaded in list(self.loaded.values()):
                await self._unload(loaded)

    async def cards(self) -> list[dict[str, Any]]:
        return [await self.card(entry.id) for entry in self.catalogue]

    async def card(self, model: str) -> dict[str, Any]:
        """The model as /v1/models lists it: the catalogue's fields, and for a loaded one its engine's."""
        entry = self.entry(model)
        card: dict[str, Any] = {"id": entry.id, "object": "model", "created": self.created, "owned_by": "minichat",
                                **entry.describe(), "loaded": entry.id in self.loaded}
        loaded = self.loaded.get(entry.id)
        if loaded is not None:
            with contextlib.suppress(ApiError):  # an engine that stopped answering still lists as loaded
                card |= {k: v for k, v in (await loaded.state.model_card()).items() if k not in card}
            card |= {"pid": loaded.handle.pid, "memory_bytes": loaded.memory(), "requests_in_flight": loaded.in_flight,
                     "idle_seconds": round(loaded.idle_seconds(), 3), "keep_alive": loaded.keep_alive,
                     "expires_in": loaded.expires_in(), "load_seconds": round(loaded.load_seconds, 3)}
        if entry.id in self._failed:
            card["load_error"] = self._failed[entry.id][1]
        return card

    def state_of(self, model: str) -> ApiState | None:
        """A loaded model's ApiState (its metrics), else None."""
        loaded = self.loaded.get(self.entry(model).id)
        return loaded.state if loaded is not None else None

    # --- loading and unloading (under the lock) ---------------------------------------------------------------------

    async def _make_room(self, entry: Entry, need: int) -> None:
        """Unload idle models, least recently used first, until `entry` fits the count and the memory budget."""
        while True:
            over = self._over(need)
            if over is None:
                return
            idle = [loaded for loaded in self.loaded.values() if loaded.in_flight == 0]
            if not idle:
                raise ApiError(503, f"cannot load {entry.id}: {over}, and every loaded model ({', '.join(self.loaded)})"
                                    f" has requests in flight; retry when one is idle", "server_error",
                               code="models_busy")
            victim = min(idle, key=lambda loaded: loaded.last_used)
            log.info("model %s: unloading it (least recently used) to load %s: %s", victim.entry.id, entry.id, over)
            await self._unload(victim)

    def _over(self, need: int) -> str | None:
        """Why one more model does not fit now, or None."""
        if len(self.loaded) >= self.limits.max_loaded:
            return f"{len(self.loaded)} models are loaded (--max-loaded-models {self.limits.max_loaded})"
        budget = self.limits.memory_bytes
        used = sum(loaded.memory() for loaded in self.loaded.values())
        if budget is not None and used + need > budget:
            return (f"{used / GIB:.2f} GiB is in use and it needs {need / GIB:.2f} "
                    f"(--models-memory-gib {budget / GIB:g})")
        return None

    async def _load(self, entry: Entry, weight_bytes: int) -> Loaded:
        address = engine_address(f"server {os.getpid()}:{self.options.port}", entry.id)
        log.info("model %s: loading %s", entry.id, entry.path)
        began = time.monotonic()
        try:
            handle = await asyncio.to_thread(self.start, entry, address, bool(self.loaded))
        except EngineStartError as e:
            raise self._failure(entry, _reason(str(e))) from e
        self._failed.pop(entry.id, None)
        client = AsyncEngineClient(address, timeout=self.options.engine_timeout, auth_token=handle.auth_token)
        state = ApiState(replace(self.options, address=address, served_model_name=entry.id), client, Metrics())
        loaded = Loaded(entry, handle, state, asyncio.create_task(state.watch_stats()), time.monotonic() - began,
                        self.limits.keep_alive, weight_bytes, self.limits.kv_bytes)
        self.loaded[entry.id] = loaded
        self.loads[entry.id] += 1
        log.info("model %s: loaded in %.1f s (engine pid %d)", entry.id, loaded.load_seconds, handle.pid)
        return loaded

    async def _unload(self, loaded: Loaded) -> None:
        """Forget the model first (no new lease can reach it across the awaits), then stop its engine."""
        if self.loaded.get(loaded.entry.id) is loaded:
            del self.loaded[loaded.entry.id]
        self.unloads[loaded.entry.id] += 1
        if loaded.expiry is not None:
            loaded.expiry.cancel()
        loaded.watcher.cancel()
        await asyncio.gather(loaded.watcher, return_exceptions=True)
        await loaded.state.close()
        await loaded.state.client.close()
        await asyncio.to_thread(loaded.handle.stop)
        log.info("model %s: unloaded", loaded.entry.id)

    def _release(self, loaded: Loaded) -> None:
        loaded.in_flight -= 1
        loaded.last_used = time.monotonic()
        if loaded.in_flight or loaded.keep_alive < 0 or self.loaded.get(loaded.entry.id) is not loaded:
            return
        if loaded.keep_alive == 0:
            self._spawn(self._expire(loaded))
        else:
            loaded.expiry = asyncio.get_running_loop().call_later(
                loaded.keep_alive, lambda: self._spawn(self._expire(loaded)))

    async def _expire(self, loaded: Loaded) -> None:
        """Unload `loaded` if it is still loaded and idle (a request may have come in since)."""
        async with self._lock:
            if self.loaded.get(loaded.entry.id) is loaded and loaded.in_flight == 0:
                log.info("model %s: idle for its keep-alive (%g s)", loaded.entry.id, loaded.keep_alive)
                await self._unload(loaded)

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- failures ---------------------------------------------------------------------------------------------------

    def _failure(self, entry: Entry, why: str) -> ApiError:
        """A model that cannot be loaded: its requests get this, and are refused at once while its file is
        unchanged (no engine is started again for a file that failed)."""
        message = f"model {entry.id} ({entry.path}) could not be loaded: {why}"
        self._failed[entry.id] = (_stamp(entry), message)
        log.error("%s", message)
        return ApiError(500, message, "server_error", code="model_load_failed")

    def _refuse_if_failed(self, entry: Entry) -> None:
        stamp, message = self._failed.get(entry.id, (None, ""))
        if stamp is not None and stamp == _stamp(entry):
            raise ApiError(500, message, "server_error", code="model_load_failed")

    def _ids(self) -> str:
        return ", ".join(f"`{i}`" for i in self.catalogue.ids())


def _exiting(pid: int) -> bool:
    """Whether Linux says the process is dead or a zombie (False where /proc cannot tell)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["Z"], ["X"])


def _stamp(entry: Entry) -> tuple[float, int]:
    """What changes when a model's file or folder is replaced."""
    try:
        st = entry.path.stat()
    except OSError:
        return (0.0, -1)
    return (st.st_mtime, st.st_size)


def _reason(start_error: str) -> str:
    """The line of a failed engine's log that says why (`minichat serve: error: ...`), else the error's first."""
    found = re.findall(r"minichat serve: error: (.+)", start_error)
    return found[-1].strip() if found else start_error.splitlines()[0]


class Leased(Response):
    """A route's response that releases its lease once it has been sent (a stream: after its last event, or when
    the client leaves)."""

    def __init__(self, response: Response, lease: Lease) -> None:
        self._response, self._lease = response, lease
        self.status_code, self.background = response.status_code, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._response(scope, receive, send)
        finally:
            self._lease.release()


class RouterCollector(Collector):
    """The catalogue's models in /metrics: loaded or not, requests in flight, memory, loads and unloads."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        r = self.router
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "loaded": GaugeMetricFamily("minichat_model_loaded", "1 while the model's engine runs.", labels=["model"]),
            "in_flight": GaugeMetricFamily("minichat_model_requests_in_flight", "HTTP requests holding the model.",
                                           labels=["model"]),
            "memory": GaugeMetricFamily("minichat_model_memory_bytes", "A loaded model's weights and KV pool.",
                                        labels=["model"]),
            "loads": CounterMetricFamily("minichat_model_loads", "Times the model's engine was started.",
                                         labels=["model"]),
            "unloads": CounterMetricFamily("minichat_model_unloads", "Times it was stopped (keep-alive, room for "
                                           "another, an explicit unload, or its engine died).", labels=["model"]),
        }
        for model in r.catalogue.ids():
            loaded = r.loaded.get(model)
            families["loaded"].add_metric([model], int(loaded is not None))
            families["in_flight"].add_metric([model], loaded.in_flight if loaded else 0)
            families["memory"].add_metric([model], loaded.memory() if loaded else 0)
            families["loads"].add_metric([model], r.loads[model])
            families["unloads"].add_metric([model], r.unloads[model])
        yield from families.values()
