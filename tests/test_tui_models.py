"""The console on a model of its own (issue 37), driven by Textual's pilot against real engines: the checkpoint's
generation_config.json as the session's defaults (shown as `model default`, sent as such, /reset back to them),
the model named in the header and kept whole in the status line at 80 columns, a system prompt sent the way a
template without a system role allows, a conversation reopened under another model saying so, and the reply
footer's numbers: a decode rate on the engine's clock (none for a reply too short to time) and the prompt
tokens the cache served.

The instruct checkpoint is the tiny llama (16k positions) copied under a name as long as a real model's, with a
generation_config.json recommending sampling settings and a chat template that refuses a system message
(tests/checkpoints.py). As in tests/test_tui.py every wait is on a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.geometry import Region
from textual.pilot import Pilot
from textual.widget import Widget
from textual.widgets import DataTable, Static
from textual.widgets._footer import FooterKey

from engine.service.client import AsyncEngineClient, EngineError, probe
from engine.service.launcher import stop_engine
from engine.service.protocol import Description
from tests.checkpoints import LONG_CONTEXT, NO_SYSTEM_TEMPLATE, UNTIL_ABORTED, instruct_view
from tests.test_tui import (
    SIZE,
    connected_app,
    last_reply,
    notes,
    run,
    start_engine,
    status,
    type_and_send,
    wait_for,
)
from tui.app import MinichatApp
from tui.chat import PhraseLine, ReplyView
from tui.link import EngineLink
from tui.session import MIN_RATE_TOKENS, Reply
from tui.sessions import SessionsScreen

pytestmark = pytest.mark.usefixtures("data_dir")  # conversations in a private directory (conftest.py)

MODEL = "TinyLlama-Instruct-test-model"  # as long as SmolLM2-135M-Instruct.Q4_1, the real model's id
GENERATION = {"temperature": 0.3, "top_p": 0.85, "top_k": 40, "repetition_penalty": 1.1}
MODEL_DEFAULT = "model default: temp 0.3, top-p 0.85, top-k 40, repetition penalty 1.1"
SIZES = [(80, 24), (160, 50)]


@pytest.fixture(scope="module")
def instruct(long_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An engine on the instruct checkpoint (the tiny llama with 16k positions, so that a reply lives until
    aborted), on a private ipc address."""
    root = tmp_path_factory.mktemp("instruct")
    model = instruct_view(long_ckpt, root / MODEL, GENERATION, NO_SYSTEM_TEMPLATE)
    with start_engine(model, f"ipc://{root}/engine.sock") as handle:
        yield handle.address


def header(app: MinichatApp) -> PhraseLine:
    assert app.current is not None
    return app.current.query_one(".chat-settings", PhraseLine)


def drawn(widget: Widget) -> str:
    """What the widget shows, padding included, its lines joined (a phrase wrapped between words reads whole)."""
    width, height = widget.outer_size
    strips = widget.render_lines(Region(0, 0, width, height))
    return " ".join(" ".join("".join(segment.text for segment in strip) for strip in strips).split())


async def streaming_and_sent(pilot: Pilot, app: MinichatApp) -> tuple[Reply, Description]:
    """Send "Hello" for a reply that runs until aborted; once it streams, the reply and what the engine says it
    was sent (asked again where the engine did not answer within describe's 5 s, as on a loaded machine)."""
    await type_and_send(pilot, "/ignore_eos on")
    await type_and_send(pilot, f"/max_tokens {UNTIL_ABORTED}")
    await type_and_send(pilot, "Hello")
    reply = last_reply(app)
    await wait_for(pilot, lambda: reply.text, "a streaming reply")
    while (sent := await app.link.describe(reply.rid)) is None or sent.params is None:
        await pilot.pause(0.1)
    return reply, sent


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x50"])
def test_the_models_generation_config_is_the_default_sent_and_reset_to(instruct: str, size: tuple[int, int]) -> None:
    """A new chat starts from what the checkpoint recommends, says so (`model default`, the model named first),
    and sends exactly that; a setting a person changes leaves the group; /reset brings the model's back. The
    template refuses a system message: the system prompt opens the first message instead, and the header says."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=instruct, autostart=False))
        async with app.run_test(size=size) as pilot:
            await connected_app(pilot)
            await wait_for(pilot, lambda: MODEL_DEFAULT in header(app).phrases, "the model's defaults in the header")
            assert header(app).phrases[0] == MODEL and MODEL_DEFAULT in drawn(header(app))
            await type_and_send(pilot, "/system Answer in verse.")
            await wait_for(pilot, lambda: "(the model's chat template has no system role)" in drawn(header(app)),
                           "the system prompt's notice")
            reply, sent = await streaming_and_sent(pilot, app)
            assert (sent.params.temperature, sent.params.top_p, sent.params.top_k, sent.params.repetition_penalty,
                    sent.params.max_tokens) == (0.3, 0.85, 40, 1.1, UNTIL_ABORTED)
            assert sent.params.min_p == 0.0  # nothing of the console's cuts a model's own distribution
            assert "<|user|>user: Answer in verse.\n\nHello\n" in sent.prompt_head  # no system message was sent
            await pilot.press("escape")
            await wait_for(pilot, lambda: reply.state == "aborted", "the abort")

            await type_and_send(pilot, "/temperature 0.7")
            assert "model default: top-p 0.85, top-k 40, repetition penalty 1.1" in header(app).phrases
            assert "temp 0.7" in header(app).phrases
            await type_and_send(pilot, "/reset")
            assert MODEL_DEFAULT in header(app).phrases and app.current.session.params.temperature == 0.3  # type: ignore[union-attr]
            assert app.current.session.params.max_tokens == 256  # type: ignore[union-attr]  # the console's, again
            assert any("back to the model's defaults" in n for n in notes(app))

    run(scenario)


def test_a_model_that_recommends_nothing_gets_llama_cpps_defaults_and_says_so(engine: str) -> None:
    """No generation_config.json (as SmolLM2's GGUF file): a chat starts from llama.cpp's server defaults, which
    suit small local models (docs/console.md), says where they come from, and sends them."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=(160, 50)) as pilot:
            await connected_app(pilot)
            said = "llama.cpp defaults: temp 0.8, top-p 0.95, top-k 40, min-p 0.05"
            await wait_for(pilot, lambda: said in header(app).phrases, "the console's defaults, named")
            reply, sent = await streaming_and_sent(pilot, app)
            assert (sent.params.temperature, sent.params.top_k, sent.params.top_p, sent.params.min_p) == \
                (0.8, 40, 0.95, 0.05)
            await pilot.press("escape")
            await wait_for(pilot, lambda: reply.state == "aborted", "the abort")

    run(scenario)


def test_a_conversation_reopened_under_another_model_says_so(engine: str, instruct: str) -> None:
    """Made with the llama engine (16k context), reopened by a console on the instruct engine: the chat says which
    model it was had with and which one answers now (in a note and a notification), and the conversation list
    names the model each conversation was had with."""

    async def first_run() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=(160, 50)) as pilot:
            await connected_app(pilot)
            for text in ("another chat", "remember the model"):  # two conversations with the llama engine
                if text == "remember the model":
                    await pilot.press("ctrl+n")
                await type_and_send(pilot, "/max_tokens 3")
                await type_and_send(pilot, text)
                await wait_for(pilot, lambda: last_reply(app).state == "done", "the reply")
            assert app.current is not None and app.current.session.model == "llama"
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: not app.is_running, "the app to quit")

    async def second_run() -> None:
        app = MinichatApp(EngineLink(address=instruct, autostart=False))
        async with app.run_test(size=(80, 24)) as pilot:
            await connected_app(pilot)
            pane = app.current
            assert pane is not None and pane.session.name == "remember the model"
            said = (f"this conversation was with llama (context {LONG_CONTEXT}); the engine now runs {MODEL} "
                    f"(context {LONG_CONTEXT}), "
                    f"which gives the replies from here on")
            note = pane.query_one(".chat-note", Static)
            await wait_for(pilot, lambda: note.display and said in drawn(note), "the note on the other model")
            # one notice, the chat in front's: the other chat says its own when it is opened (five restored chats
            # stacked five notices over half the screen)
            assert [n for n in notes(app) if "this conversation was with" in n] == [f"remember the model: {said}"]
            await pilot.press("ctrl+pageup")
            await wait_for(pilot, lambda: len([n for n in notes(app) if "this conversation was with" in n]) == 2,
                           "the other chat's notice, as it is opened")
            assert f"another chat: {said}" in notes(app)
            await pilot.press("ctrl+pagedown")
            assert len([n for n in notes(app) if "this conversation was with" in n]) == 2  # said once each
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen), "the conversation list")
            table = app.screen.query_one(DataTable)
            row = dict(zip([c.label.plain for c in table.ordered_columns], map(str, table.get_row_at(0)), strict=True))
            assert (row["conversation"], row["model"]) == ("remember the model", "llama")

    run(first_run)
    run(second_run)


async def footer_is_whole(pilot: Pilot, label: str, width: int) -> None:
    """Once the footer shows `label`'s key (the view's own), every label in it is drawn whole within `width`."""
    await wait_for(pilot, lambda: label in [key.description for key in pilot.app.query(FooterKey)], f"{label!r} shown")
    for key in pilot.app.query(FooterKey):
        drawn_label = str(key.render()).strip()
        assert key.region.right <= width and drawn_label.endswith(key.description), (drawn_label, key.region)


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x50"])
def test_the_status_line_keeps_the_model_and_every_footer_label_is_whole(instruct: str, size: tuple[int, int]) -> None:
    """At 80x24 the status line cuts the weights, pid and address, never the model's name; every footer label
    is drawn whole inside the screen, in the chat and in the ops panels (their keys differ)."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=instruct, autostart=False))
        async with app.run_test(size=size) as pilot:
            await connected_app(pilot)
            await wait_for(pilot, lambda: MODEL in status(app)[: size[0]], "the model in the status line")
            assert status(app).startswith(" connected  running 0 · waiting 0 · slots 0/4")
            await footer_is_whole(pilot, "Send", size[0])
            await pilot.press("f5", *(["f5"] if size[0] >= 120 else []))  # to the ops panels (split -> chat -> ops)
            await wait_for(pilot, lambda: app.ops_width == 100, "the ops panels")
            await footer_is_whole(pilot, "Abort", size[0])

    run(scenario)


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x50"])
def test_the_footer_times_the_decode_phase_and_says_what_the_cache_served(engine: str, size: tuple[int, int]) -> None:
    """A 5-token reply shows no rate (a rate over four steps is noise: such a reply read 2443.7 tok/s, timed as
    its tokens arrived); a longer one shows its rate over the decode phase on the engine's clock, from its first
    token to its last; the second message's prompt is served from the prefix cache in part, as the footer says."""

    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=size) as pilot:
            await connected_app(pilot)
            await type_and_send(pilot, "/ignore_eos on")
            await type_and_send(pilot, "/max_tokens 5")
            # a first message that fills a KV page by itself: the reply is sampled, and where its text re-encodes
            # otherwise than its tokens the second prompt shares none of it
            await type_and_send(pilot, "A short one, after a first line long enough to fill a page of the cache")
            short = last_reply(app)
            await wait_for(pilot, lambda: short.state == "done", "the short reply")
            view = app.query(ReplyView).last()
            footer = view.query_one(".reply-stats", PhraseLine)
            await wait_for(pilot, lambda: footer.phrases and footer.phrases[-1] == "length", "its footer")
            assert short.completion_tokens - 1 < MIN_RATE_TOKENS and short.decode_rate is None
            assert not any("tok/s" in phrase for phrase in footer.phrases), footer.phrases

            await type_and_send(pilot, "/max_tokens 40")
            await type_and_send(pilot, "And now a longer one")
            long = last_reply(app)
            await wait_for(pilot, lambda: long.state == "done", "the longer reply")
            footer = app.query(ReplyView).last().query_one(".reply-stats", PhraseLine)
            await wait_for(pilot, lambda: footer.phrases and footer.phrases[-1] == "length", "its footer")
            assert long.engine_ttft is not None and long.engine_total is not None
            rate = 39 / (long.engine_total - long.engine_ttft)  # tokens after the first, over the engine's decode
            assert f"decode {rate:.1f} tok/s" in footer.phrases
            assert long.cached_tokens and long.cached_tokens % 16 == 0  # whole pages of the first exchange
            assert f"{long.cached_tokens} prompt tok from cache" in footer.phrases
            assert all(phrase in drawn(footer) for phrase in footer.phrases)  # each drawn whole

    run(scenario)


def test_minichat_stop_is_not_undone_by_the_console(llama_ckpt: Path, tmp_path: Path) -> None:
    """The console started its engine; `minichat stop` (the real CLI) stops it: the console says so and starts
    none in its place (it used to show "reconnecting…" and start another); /reconnect starts one again."""
    address = f"ipc://{tmp_path}/mine.sock"

    async def scenario() -> None:
        link = EngineLink(address=address, model=str(llama_ckpt))
        app = MinichatApp(link)
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            first = app.link.info.pid  # type: ignore[union-attr]
            stop = await asyncio.create_subprocess_exec(sys.executable, "-m", "tui.cli", "stop", "--address", address,
                                                        stdout=asyncio.subprocess.PIPE)
            said, _ = await stop.communicate()
            assert stop.returncode == 0 and f"pid {first}" in said.decode()
            await wait_for(pilot, lambda: "the engine was stopped" in status(app), "the stopped state")
            assert link.start_failed and link.handle is None and probe(address) is None  # none started in its place
            assert status(app).endswith(f"/reconnect starts {llama_ckpt.name} again")
            await type_and_send(pilot, "/reconnect")
            await wait_for(pilot, lambda: link.state.kind == "connected" and link.info is not None
                           and link.info.pid != first, "a new engine, asked for")

    try:
        run(scenario)
    finally:
        stop_engine(address)


def base_view(src: Path, out: Path) -> Path:
    """A copy of `src` without a chat template, as a base model ships (Gemma 3 270M's GGUF file has none)."""
    shutil.copytree(src, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_a_base_model_is_talked_to_as_a_completion(long_ckpt: Path, tmp_path: Path) -> None:
    """A model without a chat template cannot take chat messages (the engine refuses them); the console says so in
    the chat's header and sends the conversation as one text the model continues: each message on a new line
    after the model's continuation of the one before."""
    model = base_view(long_ckpt, tmp_path / "TinyLlama-base")

    async def scenario(address: str) -> None:
        app = MinichatApp(EngineLink(address=address, autostart=False))
        async with app.run_test(size=(160, 50)) as pilot:
            await connected_app(pilot)
            assert app.link.info is not None and not app.link.info.chat_template
            await wait_for(pilot, lambda: any(p.startswith("completion: no chat template") for p in
                                              header(app).phrases), "the header saying how the model is talked to")
            await type_and_send(pilot, "/max_tokens 6")
            await type_and_send(pilot, "Once upon a time")
            first = last_reply(app)
            await wait_for(pilot, lambda: first.state == "done", "the first continuation")
            assert first.text
            reply, sent = await streaming_and_sent(pilot, app)
            assert sent.prompt_tail == "" and sent.prompt_head == f"Once upon a time{first.text}\nHello"
            await pilot.press("escape")
            await wait_for(pilot, lambda: reply.state == "aborted", "the abort")
        async with AsyncEngineClient(address) as client:  # chat messages are refused, saying what to send instead
            with pytest.raises(EngineError, match=r"no chat template .*/v1/completions"):
                await client.complete([{"role": "user", "content": "Hello"}], max_tokens=4)

    with start_engine(model, f"ipc://{tmp_path}/engine.sock") as handle:
        run(lambda: scenario(handle.address))
