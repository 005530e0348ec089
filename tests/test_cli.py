"""The `minichat` command line as a person meets it: `minichat status` short by default (the page map
and the request lists on request, `--watch` until Ctrl-C), and help texts that print what they say."""

from __future__ import annotations

import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import typer
from rich.text import Text
from typer.testing import CliRunner

from engine.outputs import Output
from engine.pages import PageRun, TierUse
from engine.service.client import EngineClient
from engine.service.launcher import start
from engine.service.protocol import Pages
from tests.checkpoints import UNTIL_ABORTED
from tui.cli import app
from tui.status import MAP_LINES, MAP_WIDTH, page_map, size, tier_text


@pytest.fixture(scope="module")
def engine(long_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Four slots of a 64k context (tests/checkpoints.py: LONG_CONTEXT): a pool of 16,384 pages, a 64-line map."""
    address = f"ipc://{tmp_path_factory.mktemp('cli')}/engine.sock"
    with start(address, model=str(long_ckpt), timeout=120, max_running_requests=4) as handle:
        yield handle.address


def status(*args: str) -> list[str]:
    run = CliRunner().invoke(app, ["status", *args])
    assert run.exit_code == 0, run.output
    return run.output.splitlines()


def test_status_is_short_unless_asked_for_more(engine: str) -> None:
    def generate() -> list[Output]:
        with EngineClient(engine) as client:
            return list(client.generate("keep running", max_tokens=UNTIL_ABORTED, ignore_eos=True, rid="long-one"))

    with EngineClient(engine) as operator, ThreadPoolExecutor(1) as pool:
        outputs = pool.submit(generate)
        pages = operator.wait_stats(lambda s: any(r.rid == "long-one" for r in s.running)).pages
        try:
            short = status("--address", engine)
            assert len(short) <= 8 and not any("page map" in line or "long-one" in line for line in short), short
            assert any(line.startswith("request slots ") and line.endswith("running 1") for line in short), short
            assert short[-1].startswith("totals: ")
            kv = next(line for line in short if line.startswith("KV pages "))
            weighs = size(pages.page_bytes)  # one page of float32 K and V, as the status says bytes
            assert kv.startswith(f"KV pages ({pages.page_size} tokens each, float32 pages of {weighs}): "), kv
            assert f"{pages.total} total ({pages.total * pages.page_size:,} tokens)" in kv, kv
            assert "model: family Llama; architecture LlamaForCausalLM; layers 2; " in short[1], short  # what it is
            assert short[1].endswith("; window none"), short
            running = next(line for line in short if line.startswith("running: "))
            assert "weights " in running and "cpu kernels " in running and "omp wait" not in running, running
            verbose = status("--address", engine, "--verbose")
            assert any("omp wait " in line and "onednn caches " in line for line in verbose), verbose

            mapped = status("--address", engine, "--pages")
            per_char = pages.total // (MAP_WIDTH * MAP_LINES)  # 4 slots of a 64k context: 16,384 pages
            assert per_char == 4  # after the summary, scaled to fit
            assert mapped[len(short)] == \
                f"page map (1 character = {per_char} pages; . free, R held, c cached, L locked):"
            rows = mapped[len(short) + 1:]
            assert len(rows) == MAP_LINES and "".join(r.strip() for r in rows).count("R") > 0

            listed = status("--address", engine, "--requests")
            assert "running set:" in listed and any("long-one" in line for line in listed)
            assert not any("page map" in line for line in listed)
        finally:
            operator.abort("long-one")
        assert outputs.result(timeout=60)[-1].finish_reason == "abort"  # type: ignore[union-attr]


def test_the_page_map_of_a_large_pool_fits_the_screen() -> None:
    """600,000 pages (an H200's pool of a 0.5B model) print in MAP_LINES lines, painted from three runs,
    each character the state most of its 147 pages are in."""
    pages = Pages(page_size=16, free=250_000, held=300_000, cached=50_000, locked=0, total=600_000, base=1,
                  runs=[PageRun(0, 300_000, "R", 0), PageRun(300_000, 50_000, "c"), PageRun(350_000, 250_000, ".")],
                  owners=["some-request"])
    head, *rows = page_map(pages)
    assert head == "page map (1 character = 147 pages; . free, R held, c cached, L locked):"
    assert len(rows) == MAP_LINES and all(len(row) == 2 + MAP_WIDTH for row in rows[:-1])
    line = "".join(row.strip() for row in rows)
    assert re.fullmatch(r"R+c+\.+", line) and len(line) == -(-600_000 // 147)
    assert [round(line.count(s) * 147 / 1000) for s in "Rc."] == [300, 50, 250]  # thousands of pages


def test_status_watch_prints_until_ctrl_c(engine: str) -> None:
    watch = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "tui.cli", "status", "--address", engine,
                              "--watch", "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=ctrl_c_as_on_a_terminal)
    try:
        prints, deadline = 0, time.monotonic() + 60
        with selectors.DefaultSelector() as selector:
            selector.register(watch.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
            while prints < 3:
                assert time.monotonic() < deadline, "timed out waiting for three prints"
                if selector.select(timeout=1.0):
                    prints += (watch.stdout.readline()).startswith("request slots ")  # type: ignore[union-attr]
        watch.send_signal(signal.SIGINT)
        try:
            _, stderr = watch.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after SIGINT; {still_running(watch)}")
    finally:
        watch.kill()
    assert watch.returncode == 0 and "Traceback" not in stderr, stderr


def ctrl_c_as_on_a_terminal() -> None:
    """SIGINT's default action in the child, as a terminal's foreground command has it: a suite run as a background
    job of a non-interactive shell (`pytest &`, `nohup`) ignores SIGINT, every child inherits that, and Python
    then leaves it ignored, so Ctrl-C could not end `--watch` (seen: SigIgn 0x1001007, SIGINT's bit set)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def still_running(process: subprocess.Popen[str]) -> str:
    """What a process that should have ended was doing: its signal masks (blocked, ignored, caught: is SIGINT,
    bit 2, among them?) and every thread's stack (faulthandler prints them on SIGABRT)."""
    with open(f"/proc/{process.pid}/status") as status:
        masks = [line.strip() for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
    process.send_signal(signal.SIGABRT)
    _, stderr = process.communicate(timeout=30)
    return f"{masks}; its threads:\n{stderr[-6000:]}"


def test_help_texts_keep_their_brackets() -> None:
    """Help is Rich markup: an unescaped `[...]` vanished ("Draw lengths uniformly in .")."""
    group = typer.main.get_command(app)
    commands = [group, *group.commands.values()]  # type: ignore[attr-defined]
    for command in commands:
        for param in command.params:
            text = getattr(param, "help", None) or ""
            assert Text.from_markup(text).plain == text.replace("\\[", "["), (command.name, param.name, text)
    run = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert "Draw lengths uniformly in [len*(1-r), len*(1+r)]." in run.output


def test_help_reads_at_80_columns() -> None:
    """At 80 columns a docstring's paragraph wraps as prose (typer kept its line breaks: a sentence broke after
    "--address;"), the commands are named before the ~40 engine options, which sit in a panel of their own."""
    bench = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "80"}).output
    lines = [line.strip() for line in bench.splitlines()]
    assert "engine at --address;" not in lines  # the docstring's own line end, no longer one here
    top = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"}).output
    assert top.index("serve") < top.index("Engine options (docs/engine-options.md)") < top.index("--model ")
    assert top.index("--engines") < top.index("Engine options")  # the console's own options come first


def test_a_disk_tier_shared_with_other_models_is_said_apart() -> None:
    """The disk tier is per user: its directory's bytes count other models' and checkouts' pages, its pages only
    this model's. `338/11,647 pages (664 MiB of 8.0 GiB)` read as 2.9% by pages and 8.1% by size."""
    page = 8 * 2**20 // 1024  # 8 KiB files: 8.0 GiB holds 1,048,576
    shared = TierUse(name="disk", pages=338, capacity=2**20, bytes=664 * 2**20, capacity_bytes=8 * 2**30)
    assert tier_text(shared, 0, brief=False).startswith(
        f"disk 338/1,048,576 pages of this model ({size(338 * page)}; 664 MiB of 8.0 GiB with other models' and "
        "checkouts' pages in this user's tier)")
    alone = TierUse(name="disk", pages=338, capacity=2**20, bytes=338 * page, capacity_bytes=8 * 2**30)
    assert tier_text(alone, 0, brief=False).startswith(f"disk 338/1,048,576 pages of this model ({size(338 * page)} of "
                                                   "8.0 GiB)")
