"""A catalogue of models behind one `minichat serve --http --models-dir DIR`: each model its own engine process,
started by its first request and stopped by keep-alive, by LRU when another needs its place (count or memory),
or on request; driven through real processes with the official `openai` SDK and httpx."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from engine.config import DEMO_MODEL_DIR
from engine.service.catalogue import Catalogue
from tests.gguf_files import write_gguf
from tests.test_http_api import wait_http
from tui.bench.fleet import free_port, minichat, stop

KEY = "catalogue-key"


@dataclass
class Served:
    """A running catalogue server."""

    root: str
    process: subprocess.Popen
    models: dict[str, Path]

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.root + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.root + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

    def post(self, path: str, body: object = None, key: str | None = KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.root + path, json=body, headers=headers, timeout=120)

    def card(self, model: str) -> dict:
        return self.get(f"/v1/models/{model}").json()

    def loaded(self) -> set[str]:
        return {m["id"] for m in self.get("/v1/models").json()["data"] if m["loaded"]}

    def counter(self, name: str, model: str) -> float:
        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and sample.labels.get("model") == model:
                    return sample.value
        raise AssertionError(f"{name}{{model={model}}} not in /metrics")

    def complete(self, model: str, **extra: object) -> str:
        return self.sdk().completions.create(model=model, prompt="hello", max_tokens=2, temperature=0,
                                             extra_body=extra or None).choices[0].text


def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll `condition` (a server-side state change with no event to wait on) until it holds."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def serve_catalogue(models: dict[str, Path], *options: str) -> Iterator[Served]:
    port = free_port()
    named = [arg for name, path in models.items() for arg in ("--model", f"{name}={path}")]
    process = subprocess.Popen(minichat("serve", "--http", f"127.0.0.1:{port}", *named, "--api-key", KEY,
                                        "--kv-memory-gb", "0.01", *options),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http(process, root + "/health")
        yield Served(root, process, models)
    finally:
        stop(process)
    assert process.returncode == 0, process.stderr.read() if process.stderr else ""


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path], long_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo model, two tiny checkpoints (one with a 16k context, for requests that run until aborted), a GGUF
    file, and a file that is no GGUF at all."""
    root = tmp_path_factory.mktemp("catalogue")
    broken = root / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    return {"demo": DEMO_MODEL_DIR, "llama": checkpoints["llama"], "long": long_ckpt,
            "qwen-gguf": write_gguf(checkpoints["qwen2"], root / "qwen.gguf", "qwen2"), "broken": broken}


@pytest.fixture(scope="module")
def catalogue(models: dict[str, Path]) -> Iterator[Served]:
    """At most two loaded at once; nothing unloads by time unless a request asks."""
    yield from serve_catalogue(models, "--max-loaded-models", "2", "--keep-alive", "-1")


def test_the_catalogue_is_listed_before_anything_loads(catalogue):
    cards = {m.id: m for m in catalogue.sdk().models.list().data}
    assert list(cards) == list(catalogue.models)
    for name, path in catalogue.models.items():
        card = cards[name].model_dump()
        assert (card["path"], card["loaded"]) == (str(path.resolve()), False)
        assert card["format"] == ("gguf" if path.suffix == ".gguf" else "checkpoint")
        assert card["size_bytes"] > 0
    assert catalogue.loaded() == set()


def test_requests_route_to_their_own_models_engine_through_every_api(catalogue, hf):
    """Each loaded model is its own engine process; the demo model, loaded in the background beside another
    (`--background-load`), answers as transformers does; the others through the Messages and Responses APIs."""
    message = catalogue.post("/v1/messages", {"model": "llama", "max_tokens": 3,
                                              "messages": [{"role": "user", "content": "hi"}]})
    assert message.status_code == 200 and message.json()["model"] == "llama", message.text
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    prompt = tokenizer("The king said", add_special_tokens=False)["input_ids"]
    reply = catalogue.sdk().completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert reply.model == "demo"
    expected = tokenizer.decode(hf.greedy(DEMO_MODEL_DIR, prompt, 8), skip_special_tokens=True)
    assert reply.choices[0].text == expected
    assert catalogue.loaded() == {"demo", "llama"}
    pids = {m: catalogue.card(m)["pid"] for m in ("demo", "llama")}
    response = catalogue.post("/v1/responses", {"model": "qwen-gguf", "input": "hi", "max_output_tokens": 3})
    assert response.status_code == 200 and response.json()["model"] == "qwen-gguf", response.text
    # the third one made room: the least recently used (llama) went, its engine with it
    assert catalogue.loaded() == {"demo", "qwen-gguf"}
    assert catalogue.card("demo")["pid"] == pids["demo"]
    with pytest.raises(ProcessLookupError):
        os.kill(pids["llama"], 0)
    assert catalogue.counter("minichat_model_unloads_total", "llama") == 1


def test_models_and_ps_print_the_catalogue_and_the_loaded_ones(catalogue):
    catalogue.complete("llama")
    env = {**os.environ, "MINICHAT_API_KEY": KEY}
    listed = subprocess.run(minichat("models", "--url", catalogue.root), capture_output=True, text=True, env=env,
                            timeout=60, check=True).stdout.splitlines()
    assert listed[0].split()[:4] == ["ID", "FORMAT", "SIZE", "LOADED"]
    rows = {line.split()[0]: line.split() for line in listed[1:] if line.split()[0] in catalogue.models}
    assert set(rows) == set(catalogue.models) and rows["llama"][4] == "yes"
    ps = subprocess.run(minichat("ps", "--url", catalogue.root), capture_output=True, text=True, env=env,
                        timeout=60, check=True).stdout.splitlines()
    assert {line.split()[0] for line in ps[1:]} == catalogue.loaded() and "llama" in catalogue.loaded()
    assert ps[0].split()[-1] == "PID" and all(line.split()[-1].isdigit() for line in ps[1:])


def test_an_unknown_or_missing_model_is_refused_naming_the_ids(catalogue):
    with pytest.raises(openai.NotFoundError) as e:
        catalogue.complete("gpt-4")
    assert e.value.body["code"] == "model_not_found" and "`demo`, `llama`" in e.value.body["message"]
    missing = catalogue.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    bad = catalogue.post("/v1/completions", {"model": "llama", "prompt": "x", "keep_alive": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


def test_a_model_that_cannot_load_fails_its_requests_and_the_others_keep_serving(catalogue):
    loads = catalogue.counter("minichat_model_loads_total", "broken")
    for _ in range(2):  # the second is refused at once: the file has not changed
        with pytest.raises(openai.InternalServerError) as e:
            catalogue.complete("broken")
        assert e.value.body["code"] == "model_load_failed"
        assert str(catalogue.models["broken"]) in e.value.body["message"] and "GGUF" in e.value.body["message"]
    assert catalogue.counter("minichat_model_loads_total", "broken") == loads == 0
    assert "GGUF" in catalogue.card("broken")["load_error"]
    assert catalogue.complete("llama", ignore_eos=True) is not None


def test_concurrent_first_requests_start_the_model_once(catalogue):
    catalogue.post("/v1/models/demo/unload")
    loads = catalogue.counter("minichat_model_loads_total", "demo")

    async def together() -> list[int]:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
            replies = await asyncio.gather(*(client.post(catalogue.root + "/v1/completions", json={
                "model": "demo", "prompt": f"word {i}", "max_tokens": 2}) for i in range(6)))
        return [r.status_code for r in replies]

    assert asyncio.run(together()) == [200] * 6
    assert catalogue.counter("minichat_model_loads_total", "demo") == loads + 1


def test_a_model_with_a_request_in_flight_is_never_unloaded(catalogue):
    """A stream holds `long`: an explicit unload is refused, and loading two others evicts only the idle one; with
    both slots held, a third model is refused until one is idle."""
    stream = catalogue.sdk().completions.create(model="long", prompt="hello", max_tokens=100_000, stream=True,
                                                extra_body={"ignore_eos": True})
    next(iter(stream))
    unload = catalogue.post("/v1/models/long/unload")
    assert unload.status_code == 409 and unload.json()["error"]["code"] == "model_busy"
    catalogue.complete("llama")
    catalogue.complete("demo")  # makes room by unloading llama (idle), never long
    assert catalogue.loaded() == {"long", "demo"}
    held = catalogue.sdk().completions.create(model="demo", prompt="hello", max_tokens=100_000, stream=True,
                                              extra_body={"ignore_eos": True})
    next(iter(held))
    with pytest.raises(openai.APIStatusError) as e:
        catalogue.complete("llama")
    assert e.value.status_code == 503 and e.value.body["code"] == "models_busy"
    held.close()
    stream.close()
    until(lambda: catalogue.card("long")["requests_in_flight"] == 0, "the stream's lease to end")
    assert catalogue.post("/v1/models/long/unload").json()["loaded"] is False


def test_keep_alive_unloads_an_idle_model(catalogue):
    """A request's keep_alive overrides the server's: 0 unloads right after the reply, "3s" three seconds after it."""
    catalogue.complete("llama", keep_alive=0)
    until(lambda: "llama" not in catalogue.loaded(), "keep_alive 0 to unload llama")
    catalogue.complete("llama", keep_alive="3s")
    done = time.monotonic()
    card = catalogue.card("llama")
    assert card["loaded"] and card["keep_alive"] == 3.0 and 0 < card["expires_in"] <= 3.0
    until(lambda: "llama" not in catalogue.loaded(), "keep_alive 3s to unload llama")
    assert time.monotonic() - done >= 2.9


def test_an_engine_that_dies_is_started_again_on_the_next_request(catalogue):
    catalogue.complete("llama")
    catalogue.complete("demo")
    victim, other = catalogue.card("llama")["pid"], catalogue.card("demo")["pid"]
    os.kill(victim, signal.SIGKILL)
    until(lambda: not os.path.exists(f"/proc/{victim}") or "zombie" in _state(victim), "the engine to die")
    assert catalogue.complete("llama") is not None
    assert catalogue.card("llama")["pid"] != victim and catalogue.card("demo")["pid"] == other


def test_admin_load_and_unload_need_the_key(catalogue):
    assert catalogue.post("/v1/models/llama/load", key=None).status_code == 401
    assert catalogue.post("/v1/models/llama/load").json()["loaded"] is True
    assert catalogue.post("/v1/models/llama/unload").json()["loaded"] is False
    assert catalogue.post("/v1/models/nope/load").status_code == 404


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"


def test_the_memory_budget_unloads_and_refuses_what_cannot_fit(models, tmp_path):
    """0.04 GiB holds one demo model (15 MB of weights and a 10 MB KV pool) but not two; a 1 GiB file never fits."""
    huge = tmp_path / "huge.gguf"
    with open(huge, "wb") as f:
        f.truncate(1 << 30)  # sparse: its size is what counts
    served = {"demo": models["demo"], "demo2": models["demo"], "huge": huge}
    for catalogue in serve_catalogue(served, "--models-memory-gib", "0.04", "--keep-alive", "-1"):
        catalogue.complete("demo")
        assert 20e6 < catalogue.card("demo")["memory_bytes"] < 0.04 * (1 << 30)
        catalogue.complete("demo2")
        assert catalogue.loaded() == {"demo2"}
        with pytest.raises(openai.InternalServerError) as e:
            catalogue.complete("huge")
        assert e.value.body["code"] == "model_load_failed" and "--models-memory-gib 0.04" in e.value.body["message"]
        assert catalogue.loaded() == {"demo2"}  # nothing was unloaded for a model that could never fit


def test_two_models_with_one_id_and_catalogue_flags_without_one_are_refused_at_start(models):
    result = subprocess.run(minichat("serve", "--http", f"127.0.0.1:{free_port()}", "--model", f"a={models['demo']}",
                                     "--model", f"a={models['llama']}"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "two models have the id 'a'" in result.stderr
    alone = subprocess.run(minichat("serve", "--http", f"127.0.0.1:{free_port()}", "--model", str(models["demo"]),
                                    "--keep-alive", "5"), capture_output=True, text=True, timeout=60)
    assert alone.returncode == 2 and "--keep-alive: only with a catalogue" in alone.stderr


@pytest.mark.usefixtures("data_dir")
def test_the_console_picks_each_chats_model_and_compares_models_side_by_side(models):
    """`minichat --models-dir`: f9 lists the catalogue, choosing starts that model's engine for this chat (a replica
    of the fleet view); /compare sends one prompt to several models in tabs of their own; reopened, a chat is on its
    model again."""
    from textual.widgets import DataTable

    from tests.test_tui import SIZE, connected_app, last_reply, run, type_and_send, wait_for
    from tui.app import MinichatApp
    from tui.fleet import Fleet
    from tui.picker import ModelsScreen
    from tui.shelf import ModelShelf
    from tui.tabs import tab_id

    catalogue = Catalogue.of(named=[f"demo={models['demo']}", f"llama={models['llama']}"])
    shelf = ModelShelf(catalogue, {}, Fleet([]))
    app = MinichatApp(shelf.link("demo")[0], fleet=shelf.fleet, models=shelf)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await pilot.press("f9")
            await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen), "the model picker")
            table = app.screen.query_one(DataTable)
            assert [str(table.get_row_at(i)[0]).strip() for i in range(table.row_count)] == ["▶ demo", "llama"]
            assert str(table.get_row_at(1)[3]) == "not started"
            await pilot.press("down", "enter")
            pane = app.current
            assert pane is not None and pane.link is shelf.links["llama"] and len(shelf.fleet.engines) == 2
            await type_and_send(pilot, "/max_tokens 4")
            await type_and_send(pilot, "hello")
            reply = last_reply(app)
            await wait_for(pilot, lambda: reply.state == "done", "llama's reply")
            assert pane.session.model == Path(models["llama"]).name  # the chat knows its model, and its tab says it
            assert str(app.tabs.get_tab(tab_id(pane.session)).label).endswith("@llama")
            await type_and_send(pilot, "/compare demo,llama To be")
            compared = [p for p in app.tabs.panes if p.session.group == "compare 1"]
            assert [p.link for p in compared] == [shelf.links["demo"], shelf.links["llama"]]
            await wait_for(pilot, lambda: all(p.session.turns and p.session.turns[-1].reply.state == "done"
                                              for p in compared), "both models' replies")
            await type_and_send(pilot, "/model nope")
            assert pane.link is shelf.links["llama"]

    try:
        run(scenario)
    finally:
        stopped = shelf.stop_engines()
    assert len(stopped) == 2
    for pid in stopped:
        until(lambda pid=pid: not os.path.exists(f"/proc/{pid}") or "zombie" in _state(pid), "the engines to stop")

    # the console again: the saved chat reopens on its model (llama's engine started for it), the others on the first
    again = ModelShelf(catalogue, {}, Fleet([]))
    reopened = MinichatApp(again.link("demo")[0], fleet=again.fleet, models=again)

    async def reopen() -> None:
        async with reopened.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            kept = [p for p in reopened.tabs.panes if p.session.model == Path(models["llama"]).name]
            assert kept and all(p.link is again.links["llama"] for p in kept)

    try:
        run(reopen)
    finally:
        again.stop_engines()
