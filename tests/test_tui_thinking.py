"""The console and a reasoning model, through Textual's pilot against a real engine: a tiny Qwen3 with
llama.cpp's copy of DeepSeek-R1-Distill's template (its prompt opens the think block when thinking is on)
and the engine's own `--reasoning-budget 4`, which closes the block. `/think on` sends enable_thinking:
the thinking shows folded and dimmed under the reply with its token count, f3 unfolds it, and the answer
is the reply's text alone, and the footer counts the thinking tokens and the drafts accepted (the engine
speculates with the model as its own draft, so every draft is accepted once the block is closed); `/think off`
switches it off (the template closes the block in the prompt)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from textual.widgets import Static

from engine.service.launcher import start
from tests.real_templates import DEEPSEEK_R1, real_template
from tests.test_reasoning import thinking_checkpoint
from tests.test_tui import SIZE, connected_app, last_reply, run, shown, type_and_send, wait_for
from tui.app import MinichatApp
from tui.chat import PhraseLine, ReplyView
from tui.link import EngineLink

pytestmark = pytest.mark.usefixtures("data_dir")  # conversations in a private directory (conftest.py)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("think")
    model = thinking_checkpoint(root / "ckpt", real_template(DEEPSEEK_R1))
    address = f"ipc://{root}/engine.sock"
    with start(address, model=str(model), timeout=120, reasoning_budget=4, num_pages=64,
               speculative_model=str(model), speculative_adaptive=False):
        yield address


def thinking_line(view: ReplyView) -> Static:
    return view.query_one(".reply-thinking", Static)


def test_thinking_is_folded_under_the_reply_and_switched_by_think(engine: str) -> None:
    async def scenario() -> None:
        app = MinichatApp(EngineLink(address=engine, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await type_and_send(pilot, "/max_tokens 12")
            await type_and_send(pilot, "/temperature 0")
            await type_and_send(pilot, "/think on")
            assert "thinking on" in app.current.session.settings()
            await type_and_send(pilot, "To be, or not to be")
            reply = last_reply(app)
            await wait_for(pilot, lambda: reply.state == "done", "the reply")
            # the budget: 4 tokens of thinking and the end marker the engine wrote; the rest is the answer
            assert reply.reasoning and reply.reasoning_tokens == 5 and reply.completion_tokens == 12
            assert reply.reasoning not in reply.text
            view = app.query(ReplyView).last()
            line = thinking_line(view)
            await wait_for(pilot, lambda: "thought · 5 tokens" in shown(line), "the folded thinking")
            assert line.display and reply.reasoning.strip()[:3] not in shown(line)  # folded: one line
            footer = view.query_one(".reply-stats", PhraseLine)
            await wait_for(pilot, lambda: "5 thinking" in footer.phrases, "the footer's thinking tokens")
            assert 0 < reply.accepted_tokens == reply.draft_tokens  # drafted after the block: the self-draft's
            assert f"{reply.accepted_tokens} of {reply.draft_tokens} drafts accepted" in footer.phrases
            await pilot.press("f3")
            await wait_for(pilot, lambda: reply.reasoning.strip() in shown(line), "the unfolded thinking")
            await pilot.press("f3")
            await wait_for(pilot, lambda: reply.reasoning.strip() not in shown(line), "the thinking folded again")
            # what is sent back is the answer alone: the history's assistant turn is the reply's text
            assert app.current.session.messages("next")[-2] == {"role": "assistant", "content": reply.text}
            await type_and_send(pilot, "/think off")
            await type_and_send(pilot, "And now?")
            second = last_reply(app)
            await wait_for(pilot, lambda: second.state == "done", "the second reply")
            assert second.reasoning == "" and second.reasoning_tokens == 0 and second.text
            assert not thinking_line(app.query(ReplyView).last()).display

    run(scenario)
