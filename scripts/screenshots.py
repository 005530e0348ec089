"""Regenerate the screenshots of the TUI in the README and docs/console.md: the real app, driven by
Textual's pilot, against a real engine process started for the occasion (and stopped afterwards).

    .venv/bin/python scripts/screenshots.py                   # the embedded demo model
    .venv/bin/python scripts/screenshots.py --model PATH      # any HF checkpoint directory
    .venv/bin/python scripts/screenshots.py --only request_detail --only history   # some of them

Writes SVG files into screenshots/ (or --out). Replies are sampled, so each run's text differs.
Conversations are saved in a temporary data directory, never the user's own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from textual.pilot import Pilot

from engine.config import DEMO_MODEL_DIR
from engine.service.catalogue import Catalogue
from engine.service.client import AsyncEngineClient, EngineClient
from engine.service.launcher import start
from tui.app import MinichatApp
from tui.fleet import Fleet
from tui.link import EngineLink
from tui.panels import RequestTable
from tui.panels.detail import RequestDetailScreen
from tui.picker import ModelsScreen
from tui.shelf import ModelShelf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.real_model import gemma3_gguf, smollm2_gguf

ENGINE_OPTIONS = {"max_running_requests": 8, "max_prefill_tokens": 256, "num_pages": 384}
FAN_OUT = "/fanout 4 Once more unto the breach, dear friends | To be, or not to be | Shall I compare thee to a " \
          "summer's day? | Now is the winter of our discontent"
LOAD_PROMPT = "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. " * 6


async def until(pilot: Pilot, predicate: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the app did not reach the state to photograph")
        await pilot.pause(0.05)


async def send(pilot: Pilot, text: str) -> None:
    from textual import events

    pilot.app.post_message(events.Paste(text))
    await pilot.pause()
    await pilot.press("enter")


async def connect(pilot: Pilot) -> MinichatApp:
    app = pilot.app
    assert isinstance(app, MinichatApp)
    await until(pilot, lambda: app.link.state.kind == "connected" and app.last_stats is not None)
    return app


async def chat_sessions(address: str, out: Path) -> None:
    """Several sessions streaming at once, the ops panels beside them."""
    app = MinichatApp(EngineLink(address=address, autostart=False))
    async with app.run_test(size=(150, 44)) as pilot:
        await connect(pilot)
        await send(pilot, "/max_tokens 80")
        await send(pilot, "Tell me about the sea.")
        await until(pilot, lambda: app.current.session.live is None)  # type: ignore[union-attr]
        await send(pilot, "/max_tokens 300")
        await send(pilot, "/ignore_eos on")  # long replies, so the shot catches them all streaming
        await send(pilot, FAN_OUT)
        await pilot.press("ctrl+pagedown")
        await until(pilot, lambda: app.current.session.turns[-1].reply.completion_tokens >= 40)  # type: ignore[union-attr]
        app.save_screenshot("chat-sessions.svg", str(out))


async def ops_under_load(address: str, out: Path) -> None:
    """Another client's load fills every request slot and queues the rest: the ops panels alone."""
    app = MinichatApp(EngineLink(address=address, autostart=False))
    async with app.run_test(size=(200, 56)) as pilot, AsyncEngineClient(address) as load:
        await connect(pilot)
        app.ops_width = 100
        tasks = [asyncio.ensure_future(load.complete(LOAD_PROMPT, max_tokens=200, ignore_eos=True, rid=f"bench-{i}"))
                 for i in range(14)]
        await until(pilot, lambda: len(app.last_stats.waiting) >= 3 and len(app.last_stats.running) >= 8)  # type: ignore[union-attr]
        await until(pilot, lambda: app.last_stats.counters.steps > 40)  # type: ignore[union-attr]
        app.save_screenshot("ops-under-load.svg", str(out))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def small_terminal(address: str, out: Path) -> None:
    """The chat at 80x20, where the ops panels start hidden (f5 shows them)."""
    app = MinichatApp(EngineLink(address=address, autostart=False))
    async with app.run_test(size=(80, 20)) as pilot:
        await connect(pilot)
        await send(pilot, "/max_tokens 60")
        for prompt in ("What say you, good sir?", "Speak of the king."):
            await send(pilot, prompt)
            await until(pilot, lambda: app.current.session.live is None)  # type: ignore[union-attr]
        app.save_screenshot("chat-80x20.svg", str(out))
        await pilot.press("f5")
        await until(pilot, lambda: app.ops.display)
        await pilot.pause(0.5)
        app.save_screenshot("ops-80x20.svg", str(out))


async def context_gauge(address: str, out: Path) -> None:
    """A conversation longer than the demo model's 1,024-token context: the oldest turns are trimmed
    (the rule says so) and the gauge shows how full the context is."""
    app = MinichatApp(EngineLink(address=address, autostart=False))
    async with app.run_test(size=(100, 34)) as pilot:
        await connect(pilot)
        await send(pilot, "/rename long talk")
        await send(pilot, "/system You are a player in a Shakespeare comedy.")
        await send(pilot, "/max_tokens 150")
        await send(pilot, "/ignore_eos on")
        pane = app.current
        assert pane is not None
        for prompt in ("Speak of the king.", "What news from the court?", "And of the queen?", "Who comes here?",
                       "Tell me of the war.", "What say you, good sir?", "Farewell, then."):
            await send(pilot, prompt)
            await until(pilot, lambda: pane.session.live is None)
            if pane.session.context_start:
                break
        await pilot.press("ctrl+home")
        await until(pilot, lambda: pane.query(".context-mark"))
        pane.query_one(".context-mark").scroll_visible(animate=False, top=True)
        await pilot.pause(0.3)
        app.save_screenshot("chat-context.svg", str(out))


async def session_list(address: str, out: Path) -> None:
    """The saved conversations (those of the shots before, and a few more), searchable."""
    app = MinichatApp(EngineLink(address=address, autostart=False))
    async with app.run_test(size=(100, 30)) as pilot:
        await connect(pilot)
        await pilot.press("ctrl+n")  # the tabs of the shots before came back: start a new one
        await send(pilot, "/max_tokens 30")
        for name, prompt in (("sonnets", "Shall I compare thee to a summer's day?"),
                             ("the tempest", "Full fathom five thy father lies"), ("kings", "Speak of the king.")):
            await send(pilot, f"/rename {name}")
            await send(pilot, prompt)
            await until(pilot, lambda: app.current.session.live is None)  # type: ignore[union-attr]
            await pilot.press("ctrl+n")
            await send(pilot, "/max_tokens 30")
        await pilot.press("ctrl+o")
        await until(pilot, lambda: app.screen.query("#sessions-table"))
        await pilot.pause(0.3)
        app.save_screenshot("session-list.svg", str(out))


async def request_detail(address: str, out: Path) -> None:
    """Enter on a row of the running set: one request of another client (a benchmark) in detail, its
    tokens streaming in."""
    app = MinichatApp(EngineLink(address=address, autostart=False))
    async with app.run_test(size=(130, 40)) as pilot, AsyncEngineClient(address, name="bench") as load:
        await connect(pilot)
        app.ops_width = 100
        tasks = [asyncio.ensure_future(load.complete(LOAD_PROMPT, max_tokens=400, ignore_eos=True, temperature=0.8,
                                                     seed=i, rid=f"bench-{i}")) for i in range(10)]
        await until(pilot, lambda: len(app.last_stats.running) >= 8)  # type: ignore[union-attr]
        running = app.query_one("#running", RequestTable)
        running.focus()
        await until(pilot, lambda: "bench-3" in [key.value for key in running.rows])
        running.select("bench-3")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, RequestDetailScreen) and len(app.screen.output) > 600)
        await pilot.pause(0.3)
        app.save_screenshot("request-detail.svg", str(out))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def history(address: str, out: Path) -> None:
    """Waves of load for about a minute: the history panel draws the queue, the running set and the KV
    pages in use, beside the throughput."""
    app = MinichatApp(EngineLink(address=address, autostart=False))
    async with app.run_test(size=(130, 40)) as pilot, AsyncEngineClient(address, name="bench") as load:
        await connect(pilot)
        app.ops_width = 100
        tasks: list[asyncio.Future[object]] = []
        for wave, (count, tokens) in enumerate(((6, 120), (14, 200), (4, 80), (18, 160), (10, 240), (20, 160))):
            tasks += [asyncio.ensure_future(load.complete(LOAD_PROMPT, max_tokens=tokens, ignore_eos=True,
                                                          rid=f"wave{wave}-{i}")) for i in range(count)]
            await pilot.pause(9 if wave < 5 else 4)  # a wave every 9 s: the one-second samples show each
        app.save_screenshot("history.svg", str(out))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextmanager
def http_api(address: str) -> Iterator[str]:
    """`minichat api` in front of the engine at `address`, on a free port; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "tui.cli", "api", "--address", address, "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise RuntimeError("minichat api did not come up")
        yield url
    finally:
        process.terminate()
        process.wait(30)


async def fleet(address: str, out: Path) -> None:
    """`minichat --engines`: this engine over ZeroMQ, a second one through its HTTP API, and an address where
    nothing answers; both that answer under load."""
    here = Path(address.removeprefix("ipc://")).parent
    with EngineClient(address) as client:
        model = client.info().model
    second = f"ipc://{here}/second.sock"
    with start(second, model=model, **ENGINE_OPTIONS), http_api(second) as url:
        watched = Fleet([address, url, f"ipc://{here}/stopped.sock"])
        app = MinichatApp(watched.engines[0].link, fleet=watched)
        async with app.run_test(size=(170, 16)) as pilot, AsyncEngineClient(address, name="bench") as load, \
                httpx.AsyncClient(timeout=120) as http:
            body = {"model": Path(model).name, "prompt": LOAD_PROMPT, "max_tokens": 300, "ignore_eos": True}
            tasks = [asyncio.ensure_future(load.complete(LOAD_PROMPT, max_tokens=300, ignore_eos=True,
                                                         rid=f"bench-{i}")) for i in range(10)]
            tasks += [asyncio.ensure_future(http.post(url + "/v1/completions", json=body)) for _ in range(5)]
            await until(pilot, lambda: [r.state for r in watched.readings()] == ["up", "up", "down"]
                        and all(r.ttft_p95 is not None or r.tpot_p95 is not None for r in watched.readings()[:2]))
            await pilot.pause(1.2)  # the rows redraw once a second
            app.save_screenshot("fleet.svg", str(out))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def real_model(address: str, out: Path) -> None:
    """The console's first screen on a real instruct model, straight from its GGUF file (SmolLM2-135M-Instruct
    Q4_1, fetched once into the user cache): its name in the status line and the chat's header, its weight
    format and size; each reply's footer (the second's prompt mostly from the prefix cache)."""
    here = address.removeprefix("ipc://").rsplit("/", 1)[0]
    smol = f"ipc://{here}/smollm2.sock"
    with start(smol, model=str(smollm2_gguf()), max_running_requests=4):
        # a store of its own: the other shots' conversations would reopen in tabs (and be with another model)
        app = MinichatApp(EngineLink(address=smol, autostart=False), store_path=Path(here) / "real-model.sqlite3")
        async with app.run_test(size=(120, 30)) as pilot:
            await connect(pilot)
            await send(pilot, "/temperature 0")
            for prompt in ("What is the capital of France?", "Name three things to see there, in one line each."):
                await send(pilot, prompt)
                await until(pilot, lambda: app.current.session.live is None)  # type: ignore[union-attr]
            app.save_screenshot("real-model.svg", str(out))


async def models(address: str, out: Path) -> None:
    """`minichat --models-dir`: SmolLM2 and Gemma 3 compared on one prompt (/compare), and the model picker (f9)
    over them, with the engine each model runs in."""
    here = Path(address.removeprefix("ipc://")).parent
    catalogue = Catalogue.of(named=[f"smollm2={smollm2_gguf()}", f"gemma3={gemma3_gguf()}", f"demo={DEMO_MODEL_DIR}"])
    shelf = ModelShelf(catalogue, {"max_running_requests": 4}, Fleet([]))
    app = MinichatApp(shelf.link("smollm2")[0], fleet=shelf.fleet, models=shelf, store_path=here / "models.sqlite3")
    try:
        async with app.run_test(size=(120, 30)) as pilot:
            await connect(pilot)
            await send(pilot, "/temperature 0")
            await send(pilot, "/max_tokens 48")
            await send(pilot, "/compare smollm2,gemma3 The capital of France is")
            compared = [p for p in app.tabs.panes if p.session.group]
            await until(pilot, lambda: all(p.session.turns and p.session.live is None for p in compared), 180)
            app.tabs.bring_to_front(compared[1])
            await pilot.press("f9")
            await until(pilot, lambda: isinstance(app.screen, ModelsScreen))
            await pilot.pause(0.5)
            app.save_screenshot("models.svg", str(out))
    finally:
        shelf.stop_engines()


SHOTS = (chat_sessions, ops_under_load, small_terminal, context_gauge, session_list, request_detail, history, fleet,
         real_model, models)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF checkpoint directory (default: the embedded demo model)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "screenshots")
    parser.add_argument("--only", action="append", choices=[shot.__name__ for shot in SHOTS],
                        help="take only this shot (repeatable; default: all)")
    args = parser.parse_args()
    if args.model is None and not (DEMO_MODEL_DIR / "config.json").is_file():
        parser.error(f"the demo model is not built ({DEMO_MODEL_DIR}); pass --model PATH")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="minichat-shots-") as tmp:
        os.environ["MINICHAT_DATA_DIR"] = tmp  # the shots' conversations are not the user's
        address = f"ipc://{tmp}/engine.sock"
        with start(address, model=args.model, **ENGINE_OPTIONS):
            for shoot in SHOTS:
                if args.only and shoot.__name__ not in args.only:
                    continue
                asyncio.run(shoot(address, args.out))
                print(f"{shoot.__name__}: done")
    print(f"screenshots in {args.out}")


if __name__ == "__main__":
    main()
