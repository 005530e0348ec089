"""What an idle console costs: the console's own CPU (the engine is another process) with N chat tabs
open and nothing happening, and the work behind it (timer callbacks, refresh requests, widget renders,
screen layouts), counted per stats snapshot; optionally how long a key takes to reach the prompt box
(and the screen) while many replies stream, with the console's CPU and work per second meanwhile.

    .venv/bin/python scripts/console_idle_cost.py                       # 1 and 50 tabs, 10 s windows (~2 min)
    .venv/bin/python scripts/console_idle_cost.py --tabs 50 --window 20
    .venv/bin/python scripts/console_idle_cost.py --key-latency 32      # also: keys while 32 replies stream
    .venv/bin/python scripts/console_idle_cost.py --model PATH          # any HF checkpoint (default: demo model)
    .venv/bin/python scripts/console_idle_cost.py --tabs 50 --profile 30  # where the time goes (cProfile)

The app runs headless under Textual's pilot (`App.run_test`), as the tests run it: widgets render as
in a terminal, but nothing is written to one, so a real terminal adds the cost of its escape codes
to every repaint (and of nothing when nothing is repainted). Each tab holds one short finished
exchange (--empty: none), so it has a reply's widgets as a used console does. CPU is
`time.process_time()` over the window, as a percentage of one core; conversations go to a temporary
data directory.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual import events
from textual.pilot import Pilot
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget

from engine.config import DEMO_MODEL_DIR
from engine.service.launcher import start
from tui.app import MinichatApp
from tui.chat import PromptInput
from tui.link import EngineLink

SIZE = (160, 48)  # wide: the ops panels show beside the chat, as on a desktop terminal


def hidden(node: object) -> bool:
    """Not on screen: the widget or one of its ancestors is not displayed (a hidden tab, say)."""
    return isinstance(node, Widget) and not all(n.display for n in node.ancestors_with_self if isinstance(n, Widget))


class Probe:
    """Counts, while `on`, timer callbacks (by the class of the widget that set the timer), refresh
    requests and widget renders (by class, and whether the widget was hidden), and screen layouts and
    repaints. Patches Textual's classes for the life of the process (a measuring script's privilege)."""

    def __init__(self) -> None:
        self.on = False
        self.profile = 0  # print this many functions of a profile of the window (0: none; slows the app)
        self.timers: Counter[str] = Counter()
        self.refreshes: Counter[str] = Counter()
        self.renders: Counter[str] = Counter()
        self.screen: Counter[str] = Counter()
        probe = self

        tick, refresh, render_lines = Timer._tick, Widget.refresh, Widget.render_lines
        layout, repaint = Screen._refresh_layout, Screen._compositor_refresh

        async def counted_tick(timer: Timer, *, next_timer: float, count: int) -> None:
            if probe.on:
                target = timer._target()
                probe.timers[probe.key(target, timer.name)] += 1
            await tick(timer, next_timer=next_timer, count=count)

        def counted_refresh(widget: Widget, *args: Any, **kwargs: Any) -> Widget:
            if probe.on and not isinstance(widget, Screen):
                probe.refreshes[probe.key(widget)] += 1
            return refresh(widget, *args, **kwargs)

        def counted_render_lines(widget: Widget, crop: Any) -> Any:
            if probe.on:
                probe.renders[probe.key(widget)] += 1
            return render_lines(widget, crop)

        def counted_layout(screen: Screen, *args: Any, **kwargs: Any) -> None:
            if probe.on:
                probe.screen["layouts"] += 1
            layout(screen, *args, **kwargs)

        def counted_repaint(screen: Screen) -> None:
            if probe.on:
                probe.screen["repaints"] += 1
            repaint(screen)

        Timer._tick = counted_tick  # type: ignore[method-assign]
        Widget.refresh = counted_refresh  # type: ignore[method-assign]
        Widget.render_lines = counted_render_lines  # type: ignore[method-assign]
        Screen._refresh_layout = counted_layout  # type: ignore[method-assign]
        Screen._compositor_refresh = counted_repaint  # type: ignore[method-assign]

    @staticmethod
    def key(node: object, name: str = "") -> str:
        where = "hidden " if hidden(node) else ""
        return f"{where}{type(node).__name__}" + (f" ({name})" if name and not name.startswith("Timer#") else "")

    def reset(self) -> None:
        for counter in (self.timers, self.refreshes, self.renders, self.screen):
            counter.clear()


async def until(pilot: Pilot, predicate: Callable[[], object], what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def send(pilot: Pilot, text: str) -> None:
    pilot.app.post_message(events.Paste(text))
    await pilot.pause()
    await pilot.press("enter")


def top(counter: Counter[str], per: float, n: int = 8) -> str:
    return ", ".join(f"{k} {v / per:.2f}" for k, v in counter.most_common(n)) or "none"


async def idle_cost(address: str, tabs: int, window: float, warmup: float, empty: bool, probe: Probe) -> dict:
    app = MinichatApp(EngineLink(address=address, autostart=False))
    snapshots = 0
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.state.kind == "connected" and app.last_stats is not None, "the engine")
        on_stats = app.link.on_stats

        def counted(stats: Any) -> None:
            nonlocal snapshots
            snapshots += 1
            on_stats(stats)

        app.link.on_stats = counted
        first = app.current
        assert first is not None
        await send(pilot, "/max_tokens 24")
        panes = [first] + [await app.new_session(activate=False, like=first.session) for _ in range(tabs - 1)]
        if not empty:
            for pane in panes:
                await pane.send("Tell me about the sea.")
            await until(pilot, lambda: all(p.session.live is None for p in panes), "the replies")
        app.tabs.active = f"session-{first.session.uid}"
        await pilot.pause()
        await asyncio.sleep(warmup)  # let the rates decay and the screen settle: a console left alone
        probe.reset()
        probe.on, snapshots = True, 0
        profile = cProfile.Profile() if probe.profile else None
        began_cpu, began = time.process_time(), time.monotonic()
        if profile is not None:
            profile.enable()
        await asyncio.sleep(window)
        if profile is not None:
            profile.disable()
        cpu, wall = time.process_time() - began_cpu, time.monotonic() - began
        probe.on = False
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(probe.profile)
        result = {"tabs": tabs, "window_s": round(wall, 2), "cpu_percent": round(100 * cpu / wall, 2),
                  "snapshots": snapshots, "timers": dict(probe.timers), "refreshes": dict(probe.refreshes),
                  "renders": dict(probe.renders), "screen": dict(probe.screen)}
        await app.quit_now()
    return result


async def key_latency(address: str, streams: int, presses: int, probe: Probe) -> dict:
    """Press keys in the prompt box while `streams` replies stream (in that many tabs, one of them in
    front); the time from a key's arrival to its character in the box, and to the next repaint after."""
    app = MinichatApp(EngineLink(address=address, autostart=False))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.state.kind == "connected" and app.last_stats is not None, "the engine")
        first = app.current
        assert first is not None
        for setting in ("/ignore_eos on", "/max_tokens 900"):
            await send(pilot, setting)
        await app.fan_out([f"Story number {i}: once upon a time" for i in range(streams)], like=first.session)
        await until(pilot, lambda: len(app.last_stats.running) >= streams if app.last_stats else False,
                    f"{streams} replies running")
        await until(pilot, lambda: app.current is not None and app.current.session.turns[-1].reply.text,
                    "text in the front tab")
        box = app.current.query_one(PromptInput) if app.current is not None else None
        assert box is not None and app.focused is box, app.focused
        applied: list[float] = []
        painted: list[float] = []
        state: dict[str, float | None] = {"sent": None, "applied": None}
        replace, screen = box._replace_via_keyboard, app.screen
        repaint = screen._compositor_refresh

        def on_replace(*args: Any, **kwargs: Any) -> Any:
            result = replace(*args, **kwargs)
            if state["sent"] is not None and state["applied"] is None:
                state["applied"] = time.perf_counter()
                applied.append(state["applied"] - state["sent"])
            return result

        def on_repaint() -> None:
            repaint()
            if state["applied"] is not None and state["sent"] is not None:
                painted.append(time.perf_counter() - state["sent"])
                state["sent"] = None

        box._replace_via_keyboard = on_replace  # type: ignore[method-assign]
        screen._compositor_refresh = on_repaint  # type: ignore[method-assign]
        profile = cProfile.Profile() if probe.profile else None
        if profile is not None:
            profile.enable()
        probe.reset()
        probe.on = True
        began_cpu, began = time.process_time(), time.monotonic()
        for i in range(presses):
            char = "abcdefghijklmnopqrstuvwxyz"[i % 26]
            state["sent"], state["applied"] = time.perf_counter(), None
            app.post_message(events.Key(char, char))
            deadline = time.monotonic() + 10
            while state["sent"] is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.13 + 0.05 * (i % 3))  # spaced unevenly, to land anywhere in a frame
        wall = time.monotonic() - began
        cpu = 100 * (time.process_time() - began_cpu) / wall
        probe.on = False
        if profile is not None:
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(probe.profile)
        running = len(app.last_stats.running) if app.last_stats else 0
        text = box.text
        await app.quit_now()
    typed = "".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(presses))
    return {"streams": streams, "running_at_end": running, "presses": presses, "cpu_percent": round(cpu, 1),
            "window_s": round(wall, 2), "timers": dict(probe.timers), "refreshes": dict(probe.refreshes),
            "renders": dict(probe.renders), "screen": dict(probe.screen),
            "typed_intact": text == typed,
            "applied_ms_median": round(1e3 * statistics.median(applied), 2),
            "applied_ms_p90": round(1e3 * statistics.quantiles(applied, n=10)[-1], 2),
            "painted_ms_median": round(1e3 * statistics.median(painted), 2) if painted else None,
            "painted_ms_p90": round(1e3 * statistics.quantiles(painted, n=10)[-1], 2) if len(painted) > 1 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tabs", default="1,50", help="comma-separated tab counts to measure (default 1,50; '': none)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured per tab count")
    parser.add_argument("--warmup", type=float, default=35.0,
                        help="seconds left alone before measuring (35: the rate sparklines, a 30 s time axis, "
                             "have scrolled the replies' burst away)")
    parser.add_argument("--empty", action="store_true", help="tabs without a conversation")
    parser.add_argument("--model", default=str(DEMO_MODEL_DIR), help="HF checkpoint directory (default: demo model)")
    parser.add_argument("--key-latency", type=int, default=0, metavar="N",
                        help="also measure key latency while N replies stream (0: skip)")
    parser.add_argument("--presses", type=int, default=20, help="keys pressed for --key-latency")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N costliest functions of each measured window (profiling slows the app)")
    args = parser.parse_args()

    probe = Probe()
    probe.profile = args.profile
    results: dict[str, Any] = {"idle": [], "key_latency": None}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MINICHAT_DATA_DIR"] = str(Path(tmp) / "data")
        address = f"ipc://{tmp}/engine.sock"
        options = {"max_running_requests": max(32, args.key_latency), "max_prefill_tokens": 2048}
        with start(address, model=args.model, timeout=300, **options):
            for tabs in (int(t) for t in args.tabs.split(",") if t):
                r = asyncio.run(idle_cost(address, tabs, args.window, args.warmup, args.empty, probe))
                results["idle"].append(r)
                per = max(1, r["snapshots"])
                print(f"{tabs:3d} tabs: {r['cpu_percent']:5.2f}% of a core over {r['window_s']} s, "
                      f"{r['snapshots']} stats snapshots; per snapshot:")
                print(f"    screen    {top(Counter(r['screen']), per)}")
                print(f"    timers    {top(Counter(r['timers']), per)}")
                print(f"    refreshes {top(Counter(r['refreshes']), per)}")
                print(f"    renders   {top(Counter(r['renders']), per)}")
            if args.key_latency:
                r = results["key_latency"] = asyncio.run(key_latency(address, args.key_latency, args.presses, probe))
                print(f"key latency, {r['streams']} replies streaming ({r['running_at_end']} still running at the "
                      f"end), {r['presses']} keys: applied median {r['applied_ms_median']} ms (p90 "
                      f"{r['applied_ms_p90']}), painted median {r['painted_ms_median']} ms (p90 "
                      f"{r['painted_ms_p90']}); typed text intact: {r['typed_intact']}; the console used "
                      f"{r['cpu_percent']}% of a core meanwhile; per second:")
                for what in ("screen", "timers", "refreshes", "renders"):
                    print(f"    {what:<9} {top(Counter(r[what]), r['window_s'])}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
