"""KV tiers under the radix cache (engine/kv/tiers.py): a prefix served from the pool, host memory or disk gives the
cold run's tokens (and transformers'), with KV bitwise equal to KV computed afresh; bad files are refused and
recomputed; the disk cap holds; engines share a directory; a request aborted while its KV loads frees everything;
and the tiers keep to the scheduler's other paths (retraction, n choices, prompt log-probabilities, speculation,
sliding windows)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv import tiers
from engine.kv.disk import HEADER, SUFFIX, DiskTier, PageFile
from engine.kv.tiers import chain_key
from engine.scheduler.snapshot import SchedulerCounters

PAGE = 16


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run(llm: LLM, prompt: list[int], params: SamplingParams | None = None) -> list[int]:
    return llm.generate([prompt], params or greedy())[0].token_ids


def hits(llm: LLM) -> SchedulerCounters:
    return llm.stats().counters


def kv_of(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The pool's K/V of the prompt's cached full pages (the prefix cache's match)."""
    return llm.kv.read_pages(llm.cache.match_prefix(prompt).pages)


def written(path: Path, where: Path, prompts: list[list[int]], params: SamplingParams | None = None,
            **options: object) -> list[list[int]]:
    """The prompts' tokens from an engine on `where` that then stops: their pages are on disk for the next one."""
    with LLM(str(path), kv_cache_dir=str(where), **options) as first:
        return [o.token_ids for o in first.generate(prompts, params or greedy())]


def page_files(root: Path) -> list[Path]:
    return sorted(root.rglob(f"*{SUFFIX}"))


def page_paths(root: Path, prompt: list[int]) -> list[Path]:
    """Where the disk tier keeps the prompt's full pages, in order (one model's files under `root`)."""
    (fingerprint_dir,) = [d for d in root.iterdir() if d.is_dir()]
    parent, paths = bytes.fromhex(fingerprint_dir.name), []
    for start in range(0, len(prompt) - PAGE + 1, PAGE):
        parent = chain_key(parent, tuple(prompt[start:start + PAGE]))
        paths.append(fingerprint_dir / parent.hex()[:2] / f"{parent.hex()}{SUFFIX}")
    return paths


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_a_prefix_from_each_tier_gives_the_cold_runs_tokens_and_kv(llama_ckpt, hf, tmp_path, overlap):
    """The same prompt cold (no tiers), from the pool, from the host tier (after the pool evicted it) and from disk
    after a restart: the same greedy tokens as transformers, and the loaded KV bitwise the KV computed afresh."""
    prompt = ids(90, 1)  # 5 full pages, whose last token is not the prompt's (always computed)
    with LLM(str(llama_ckpt), kv_disk_gib=0, overlap=overlap) as cold_engine:
        assert cold_engine.stats().pages.tiers == ()
        cold = run(cold_engine, prompt)
        fresh = kv_of(cold_engine, prompt)
    hf.check_greedy(cold, llama_ckpt, prompt, 8)
    assert fresh.shape[0] == 5

    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path), kv_host_gib=1 / 1024, num_pages=16,
             overlap=overlap) as llm:
        assert run(llm, prompt) == cold  # computed, and written through to disk
        assert run(llm, prompt) == cold and hits(llm).hit_tokens_pool == 80
        for seed in range(4):  # other prompts take the pool: the first one's pages move to host memory
            run(llm, ids(90, 10 + seed))
        assert llm.cache.match_prefix(prompt).pages == []
        assert run(llm, prompt) == cold and hits(llm).hit_tokens_host == 80
        assert torch.equal(kv_of(llm, prompt), fresh)
        llm.check_integrity()

    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path), overlap=overlap) as restarted:
        rid = restarted.add_request(prompt, greedy())
        while (detail := restarted.describe(rid)) is not None and detail.state == "waiting":
            restarted.step()
        assert detail is not None and (detail.cached_tokens, detail.host_tokens, detail.disk_tokens) == (80, 0, 80)
        while restarted.has_unfinished():
            restarted.step()
        out = restarted.generate([prompt], greedy())[0]  # and again, from the pool now
        assert out.token_ids == cold and out.usage.cached_tokens == 80
        assert hits(restarted).hit_tokens_disk == 80 and hits(restarted).hit_tokens_pool == 80
        assert torch.equal(kv_of(restarted, prompt), fresh)
        restarted.check_integrity()


DAMAGES = {"corrupt": "corrupt", "truncated": "truncated", "foreign": "foreign", "fifo": "unreadable",
           "link": "unreadable", "sparse": "corrupt"}
"""Each way a page file is damaged, and the reason the tier gives when it refuses it."""


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_bad_page_file_is_refused_counted_logged_deleted_and_recomputed(llama_ckpt, hf, tmp_path, damage, caplog):
    """Page 3 of 5 is damaged: a byte flipped in its K/V, cut short, another model's page under its name, a FIFO (a
    read would wait for a writer forever), a link out of the directory (to a file of the user's), or a sparse file of
    64 GiB (read whole, it would take that much memory). The next engine loads pages 0-2, refuses page 3 (counted
    by why, logged, deleted: the link, never its target) and computes the rest: the cold run's tokens."""
    prompt = ids(90, 2)
    (cold,) = written(llama_ckpt, tmp_path / "kv", [prompt])
    hf.check_greedy(cold, llama_ckpt, prompt, 8)
    bad = page_paths(tmp_path / "kv", prompt)[3]
    data = bytearray(bad.read_bytes())
    if damage == "corrupt":
        data[HEADER.size + 8 * PAGE + 100] ^= 0x10
        bad.write_bytes(data)
    elif damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "foreign":  # the same tokens' page 3 of the model in bfloat16: another fingerprint, a valid file
        written(llama_ckpt, tmp_path / "other", [prompt], dtype="bfloat16")
        foreign = page_paths(tmp_path / "other", prompt)[3]
        bad.write_bytes(foreign.read_bytes())
    elif damage == "fifo":
        bad.unlink()
        os.mkfifo(bad)
    elif damage == "link":
        outside = tmp_path / "notes.txt"
        outside.write_bytes(data)  # even a valid page's bytes are not read through a link
        bad.unlink()
        bad.symlink_to(outside)
    else:
        with bad.open("r+b") as f:
            f.truncate(64 << 30)

    caplog.set_level(logging.WARNING, logger="engine.kv.disk")
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path / "kv")) as llm:
        out = llm.generate([prompt], greedy())[0]
        assert out.token_ids == cold and out.usage.cached_tokens == 48
        tier = llm.stats().pages.tiers[0]
        assert tier.rejected == {DAMAGES[damage]: 1} and tier.loaded == 3
        assert hits(llm).hit_tokens_disk == 48
        llm.check_integrity()
        assert llm.flush_kv()
        assert bad.is_file() and not bad.is_symlink()  # deleted when refused, written again from the recomputed page
    assert any(DAMAGES[damage] in r.getMessage() and str(bad) in r.getMessage() for r in caplog.records)
    if damage == "link":
        assert (tmp_path / "notes.txt").read_bytes() == data
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path / "kv")) as again:  # the rewritten file is good
        assert run(again, prompt) == cold and hits(again).hit_tokens_disk == 80
        assert again.stats().pages.tiers[0].rejected == {}


def test_a_huge_sparse_file_does_not_evict_the_good_pages(llama_ckpt, tmp_path):
    """A 64 GiB sparse file named as a page of another model counts the blocks it takes (next to nothing) against a
    cap of 1 MiB: the good pages stay, and a restarted engine loads them all."""
    prompt = ids(90, 4)
    (cold,) = written(llama_ckpt, tmp_path, [prompt], kv_disk_gib=1 / 1024)
    good = page_files(tmp_path)
    key = "ab" * 16
    other = tmp_path / ("cd" * 16) / key[:2] / f"{key}{SUFFIX}"
    other.parent.mkdir(parents=True)
    with other.open("wb") as f:
        f.truncate(64 << 30)
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path), kv_disk_gib=1 / 1024) as llm:
        assert run(llm, prompt) == cold and hits(llm).hit_tokens_disk == 80
        llm.check_integrity()
    assert len(good) >= 5 and all(p.is_file() for p in good)


@pytest.mark.parametrize("linked", ["cache", "fingerprint"])
def test_a_linked_cache_directory_is_refused(llama_ckpt, tmp_path, caplog, linked):
    """The cache directory, or a model's directory in it, replaced by a link: the disk tier refuses it (logged, and
    off), and nothing is written to where the link leads."""
    prompt = ids(40, 5)
    written(llama_ckpt, tmp_path / "kv", [prompt])  # makes the fingerprint directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if linked == "cache":
        (tmp_path / "link").symlink_to(elsewhere)
        where = tmp_path / "link"
    else:
        (fingerprint_dir,) = [d for d in (tmp_path / "kv").iterdir() if d.is_dir()]
        shutil.rmtree(fingerprint_dir)
        fingerprint_dir.symlink_to(elsewhere)
        where = tmp_path / "kv"
    caplog.set_level(logging.WARNING, logger="engine.kv.tiers")
    with LLM(str(llama_ckpt), kv_cache_dir=str(where)) as llm:
        run(llm, prompt)
        assert llm.stats().pages.tiers == ()
    assert not any(elsewhere.iterdir())
    assert any("is a link" in r.getMessage() and "KV disk tier off" in r.getMessage() for r in caplog.records)


def test_reads_past_the_load_deadline_are_computed_instead(llama_ckpt, tmp_path, monkeypatch):
    """With the deadline at 0 and the disk's reads held until the request is done (a stuck file), every read is late
    when the scheduler looks: the pages are computed, counted as late, and the tokens are the cold run's. (Unheld, a
    read could finish before the scheduler's first look on a loaded machine, and be used.)"""
    prompt = ids(90, 6)
    (cold,) = written(llama_ckpt, tmp_path, [prompt])
    monkeypatch.setattr(tiers, "LOAD_DEADLINE", 0.0)
    stuck = threading.Event()
    read = DiskTier._read

    def held(self: DiskTier, page: PageFile) -> torch.Tensor:
        stuck.wait(60)
        return read(self, page)

    monkeypatch.setattr(DiskTier, "_read", held)
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path)) as llm:
        try:
            out = llm.generate([prompt], greedy())[0]
        finally:
            stuck.set()
        tier = llm.stats().pages.tiers[0]
        assert out.token_ids == cold and tier.rejected.get("late", 0) >= 1
        llm.check_integrity()


def test_pages_are_used_only_by_the_same_weights_dtype_and_layout(llama_ckpt, tmp_path):
    """The disk tier's pages of one engine serve another only if it computes the same K/V: the same weights' bytes
    (a copy of the checkpoint elsewhere: yes; other weights of the same shape: no), dtype, page size and kernels."""
    import shutil

    from tests.checkpoints import make_checkpoint

    prompt = ids(90, 12)
    written(llama_ckpt, tmp_path / "kv", [prompt])
    copy = shutil.copytree(llama_ckpt, tmp_path / "copy")
    other = make_checkpoint("llama", tmp_path / "other", seed=1)
    for path, options, served in ((copy, {}, 80), (other, {}, 0), (llama_ckpt, {"dtype": "bfloat16"}, 0),
                                  (llama_ckpt, {"page_size": 8}, 0), (llama_ckpt, {"attention_backend": "torch"}, 0)):
        with LLM(str(path), kv_cache_dir=str(tmp_path / "kv"), **options) as llm:
            run(llm, prompt)
            assert hits(llm).hit_tokens_disk == served, (path, options)
            assert llm.stats().pages.tiers[0].rejected == {}


def test_the_disk_cap_holds_and_keeps_the_most_recently_used(llama_ckpt, tmp_path):
    """A cap of ten page files under 36 pages written: the directory never passes it, the oldest prompts' pages go,
    the newest one's stay."""
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path), kv_disk_gib=1e-9) as probe:  # below one file: nothing
        run(probe, ids(40, 3))
        assert probe.flush_kv() and page_files(tmp_path) == [] and probe.stats().pages.tiers[0].skipped > 0
        file_bytes = probe.cache.tiers.disk.file_bytes
    cap = 10 * file_bytes
    prompts = [ids(90, 20 + i) for i in range(6)]  # 6 full pages each, with their output
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path), kv_disk_gib=cap / 2**30) as llm:
        for prompt in prompts:
            run(llm, prompt)
            assert llm.flush_kv()
            assert sum(f.stat().st_size for f in page_files(tmp_path)) <= cap
            llm.check_integrity()
        tier = llm.stats().pages.tiers[0]
        assert tier.stored == 36 and tier.pages == len(page_files(tmp_path)) <= 10 and tier.bytes <= cap
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path), kv_disk_gib=cap / 2**30) as restarted:
        run(restarted, prompts[-1])
        assert hits(restarted).hit_tokens_disk == 80
        run(restarted, prompts[0])
        assert hits(restarted).hit_tokens_disk == 80  # long gone


def test_an_abort_while_its_kv_loads_frees_everything(llama_ckpt, tmp_path):
    """A request aborted while its pages load from disk, and one aborted once they are in (it then waits for a
    slot, holding them): every page and slot free or cached at idle, no load left, the tiers consistent."""
    prompt, other = ids(200, 4), ids(30, 5)
    written(llama_ckpt, tmp_path, [prompt])
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path), max_running_requests=1) as llm:
        rid = llm.add_request(prompt, greedy())
        llm.step()  # the load starts: 12 pages on their way
        (waiting,) = llm.stats().waiting
        assert waiting.reason == "loading_kv" and llm.stats().pages.held == 12
        llm.abort(rid)
        while llm.has_unfinished():
            llm.step()
        llm.check_integrity()
        assert llm.stats().pages.held == 0 and not llm.cache.loading

        busy = llm.add_request(other, SamplingParams(max_tokens=200, ignore_eos=True))
        llm.step()  # it holds the only slot
        rid = llm.add_request(prompt, greedy())
        while llm.request(rid).kv.loading is None or llm.request(rid).kv.waits_for_load:
            llm.step()  # loaded: in the tree, locked for it, waiting for the slot
        assert llm.stats().pages.locked >= 12 and llm.stats().waiting[0].reason == "slot"
        llm.abort(rid)
        llm.abort(busy)
        while llm.has_unfinished():
            llm.step()
        llm.check_integrity()
        assert llm.stats().pages.locked == 0 and llm.stats().pages.held == 0


def test_two_engines_share_a_directory(llama_ckpt, tmp_path):
    """Two engine processes on one directory write the same prompts' pages at once and their own: a third engine
    loads every prompt whole from it, with no file refused and no temporary file left."""
    from engine.service.client import EngineClient
    from engine.service.launcher import start

    shared, own = [ids(70, 30 + i) for i in range(3)], [[ids(70, 40 + 10 * e + i) for i in range(2)] for e in (0, 1)]
    engines = [start(f"ipc://{tmp_path}/e{e}.sock", model=str(llama_ckpt), timeout=120,
                     kv_cache_dir=str(tmp_path / "kv"), max_running_requests=4) for e in (0, 1)]
    try:
        import concurrent.futures

        def drive(e: int) -> list[list[int]]:
            with EngineClient(engines[e].address) as client:
                return [client.complete(p, greedy()).token_ids for p in shared + own[e]]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(drive, (0, 1)))
    finally:
        for engine in engines:
            engine.stop()
    assert outs[0][:3] == outs[1][:3]
    assert not list((tmp_path / "kv").rglob("*.tmp"))
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path / "kv")) as third:
        for prompt, expected in zip(shared + own[0] + own[1], outs[0] + outs[1][3:], strict=True):
            before = hits(third).hit_tokens_disk
            assert run(third, prompt) == expected
            assert hits(third).hit_tokens_disk - before == 64
        assert third.stats().pages.tiers[0].rejected == {}
        third.check_integrity()


def test_a_disk_that_refuses_writes_is_a_logged_degradation(llama_ckpt, hf, tmp_path):
    """Every page write fails (as on a full disk: a file-size limit makes each one fail with EFBIG, in an engine of
    its own process): the engine serves on with the same tokens, says so once in its log, counts the failures
    and the pages it did not store."""
    prompt = ids(90, 6)
    script = textwrap.dedent(f"""
        import json, resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from engine import LLM, SamplingParams
        llm = LLM({str(llama_ckpt)!r}, kv_cache_dir={str(tmp_path)!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        outs = [llm.generate([{prompt!r}], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
                for _ in range(2)]
        llm.flush_kv()
        tier = llm.stats().pages.tiers[0]
        print(json.dumps({{"outs": outs, "errors": tier.write_errors, "skipped": tier.skipped,
                          "degraded": tier.degraded, "pages": tier.pages}}))
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent, env=os.environ | {"PYTHONPATH": "."})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    hf.check_greedy(report["outs"][0], llama_ckpt, prompt, 8)
    assert report["outs"][1] == report["outs"][0]
    assert report["errors"] >= 1 and report["pages"] == 0 and "paused" in report["degraded"]
    assert report["errors"] + report["skipped"] >= 6  # every page either failed or was not tried while paused
    assert done.stderr.count("KV disk tier: writing to") == 1 and "File too large" in done.stderr
    assert not list(tmp_path.rglob("*.tmp"))


def test_tiers_are_refused_where_they_cannot_go(llama_ckpt, tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ValueError, match=r"kv_cache_dir .*a-file/kv: Not a directory"):
        LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path / "a-file" / "kv"))
    for options in ({"kv_host_gib": 1.0, "prefix_cache": "naive"}, {"kv_disk_gib": -1.0},
                    {"kv_cache_dir": "/tmp/x", "tensor_parallel_size": 2}):
        with pytest.raises(ValueError, match="kv_"):
            LLM(str(llama_ckpt), **options)
    with LLM(str(llama_ckpt), prefix_cache="naive") as naive:  # the defaults just stay off
        assert naive.stats().pages.tiers == () and naive.execution["kv_tiers"] == "none below the pool"


# -- the tiers beside the scheduler's other paths -------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_retraction_with_tiers_stays_exact(llama_ckpt, hf, tmp_path, overlap):
    """A pool too small for the crowd, host and disk tiers under it: retracted requests' pages move down and come
    back; a second pass finds the prompts below the pool and loads them, retractions and all; transformers'
    tokens throughout."""
    from tests.test_retraction import OUT, assert_all_free, crowd, tight

    prompts = crowd()[:32]
    llm = tight(llama_ckpt, overlap=overlap, kv_cache_dir=str(tmp_path), kv_host_gib=1 / 1024)
    outs = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=OUT))]
    assert llm.stats().counters.retractions >= 3
    for prompt, out in zip(prompts, outs, strict=True):
        hf.check_greedy(out, llama_ckpt, prompt, OUT, eos=sorted(llm.eos_ids))
    assert_all_free(llm)
    again = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=OUT))]
    assert again == outs
    assert hits(llm).hit_tokens_host + hits(llm).hit_tokens_disk > 0
    assert_all_free(llm)
    llm.close()


def test_n_choices_share_a_prefix_loaded_from_disk(llama_ckpt, hf, tmp_path):
    """After a restart the first of three choices loads the prompt from disk and the others share it from the pool."""
    prompt = ids(70, 7)
    written(llama_ckpt, tmp_path, [prompt])
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path)) as llm:
        outs = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, n=3))
        assert len(outs) == 3
        for out in outs:
            hf.check_greedy(out.token_ids, llama_ckpt, prompt, 8)
        assert hits(llm).hit_tokens_disk == 64 and hits(llm).hit_tokens_pool == 2 * 64
        llm.check_integrity()


def test_prompt_logprobs_skip_the_tiers(llama_ckpt, hf, tmp_path):
    """A prompt to score is computed whole: its pages on disk are not loaded, its log-probabilities transformers'."""
    from tests.test_logprobs import assert_logprobs

    prompt = ids(70, 8)
    written(llama_ckpt, tmp_path, [prompt])
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path)) as llm:
        scored = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
        assert scored.usage.cached_tokens == 0 and hits(llm).hit_tokens_disk == 0
        assert llm.stats().pages.tiers[0].loaded == 0
        assert scored.prompt_logprobs is not None
        assert_logprobs(scored.prompt_logprobs[1:], hf.log_softmax(llama_ckpt, prompt)[:-1], prompt[1:], 2)
        llm.check_integrity()


def test_speculative_decoding_over_a_prefix_from_disk(llama_ckpt, hf, tmp_path):
    """Prompt lookup's drafts verified after the prompt came from disk: the rejected drafts' pages go back (freed,
    never cached), the output is transformers', every tier adds up at idle."""
    from tests.test_speculative import prompts as repeating

    batch = repeating()[:3]
    written(llama_ckpt, tmp_path, batch, greedy(24))
    with LLM(str(llama_ckpt), kv_cache_dir=str(tmp_path), speculative="ngram", speculative_adaptive=False) as llm:
        outs = llm.generate(batch, greedy(24))
        for prompt, out in zip(batch, outs, strict=True):
            hf.check_greedy(out.token_ids, llama_ckpt, prompt, 24)
        c = llm.stats().counters
        assert c.spec_drafts > 0 and c.spec_accepted_tokens < c.spec_draft_tokens
        assert c.hit_tokens_disk == sum((len(p) - 1) // PAGE * PAGE for p in batch)
        llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_a_sliding_window_models_early_pages_reach_disk(checkpoints, hf, tmp_path, overlap):
    """Every layer windowed (12 positions): pages the window passed are handed to the cache while the request runs,
    written through once the batch that may still write them is processed; after a restart the whole prefix
    comes back from disk, and the tokens are transformers'."""
    path = checkpoints["mistral_window"]
    prompt = ids(70, 9)
    (cold,) = written(path, tmp_path, [prompt], greedy(12), max_prefill_tokens=16, overlap=overlap, page_size=8)
    hf.check_greedy(cold, path, prompt, 12)
    with LLM(str(path), kv_cache_dir=str(tmp_path), overlap=overlap, page_size=8) as llm:
        assert run(llm, prompt, greedy(12)) == cold
        assert hits(llm).hit_tokens_disk == 64
        llm.check_integrity()


def test_the_api_status_and_metrics_tell_the_tiers(llama_ckpt, tmp_path):
    """Through `serve --http`, restarted on the same directory: the SDK's cached_tokens counts the prompt tokens that
    came from disk, /metrics has the disk hits and files, `minichat status` a line per tier."""
    import httpx
    import openai
    from typer.testing import CliRunner

    from tests.served import serve_http
    from tui.cli import app

    prompt = "A page of the cache holds sixteen tokens of keys and values. " * 6
    options = ("--kv-cache-dir", str(tmp_path))
    cold = []
    for url, _ in serve_http(llama_ckpt, *options):
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        cold.append(sdk.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0))
    assert cold[0].usage.prompt_tokens_details.cached_tokens == 0
    for url, address in serve_http(llama_ckpt, *options):  # restarted: the prompt's pages are on disk
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        out = sdk.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0)
        n = out.usage.prompt_tokens
        assert out.usage.prompt_tokens_details.cached_tokens == (n - 1) // PAGE * PAGE
        assert out.choices[0].text == cold[0].choices[0].text
        metrics = httpx.get(f"{url}/metrics").text
        assert f'minichat_kv_hit_tokens_total{{tier="disk"}} {float((n - 1) // PAGE * PAGE)}' in metrics
        assert 'minichat_kv_tier_pages{tier="disk"}' in metrics
        assert 'minichat_kv_disk_rejected_files_total{reason="corrupt"} 0.0' in metrics
        status = CliRunner().invoke(app, ["status", "--address", address])
        assert status.exit_code == 0, status.output
        (line,) = [s for s in status.output.splitlines() if s.startswith("KV pages ")]
        assert "pool 0 tokens hit" in line and f"{(n - 1) // PAGE * PAGE:,} tokens hit" in line and "disk " in line


def test_the_console_resumes_a_conversation_from_disk_after_a_restart(long_ckpt, tmp_path, data_dir):
    """A conversation had with one engine, whose pages reach its disk tier as each reply ends; the console quits,
    the engine restarts: the reopened tab sends its history ahead, which the new engine loads from disk, and the
    next message finds the whole conversation cached."""
    import asyncio

    from engine.service.launcher import start
    from tests.test_tui import SIZE, connected_app, last_reply, type_and_send, wait_for
    from tui.app import MinichatApp
    from tui.link import EngineLink
    from tui.panels.grids import PageGrid

    address = f"ipc://{tmp_path}/engine.sock"
    options = {"max_running_requests": 4, "max_prefill_tokens": 256, "kv_cache_dir": str(tmp_path / "kv")}

    def disk(app: MinichatApp) -> tuple[int, int]:
        stats = app.last_stats
        tier = next((t for t in stats.pages.tiers if t.name == "disk"), None) if stats is not None else None
        return (tier.stored, stats.counters.hit_tokens_disk) if tier is not None and stats is not None else (0, 0)

    async def first_run() -> None:
        app = MinichatApp(EngineLink(address=address, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            await type_and_send(pilot, "/max_tokens 24")
            for text in ("Tell me about the sea and the ships upon it.", "And what of the harbour at night?"):
                await type_and_send(pilot, text)
                await wait_for(pilot, lambda: last_reply(app).state == "done", "the reply")
            prompt = last_reply(app).prompt_tokens or 0
            await wait_for(pilot, lambda: disk(app)[0] >= prompt // PAGE, "the conversation written through")
            await pilot.press("ctrl+q")
            await wait_for(pilot, lambda: not app.is_running, "the app to quit")
            history.append(prompt + (last_reply(app).completion_tokens or 0))

    async def second_run() -> None:
        app = MinichatApp(EngineLink(address=address, autostart=False))
        async with app.run_test(size=SIZE) as pilot:
            await connected_app(pilot)
            assert app.current is not None and len(app.current.session.turns) == 2
            # the history's pages come up from disk (the hit grows as the stats report its loads)
            await wait_for(pilot, lambda: disk(app)[1] >= (history[0] - 2 * PAGE) // PAGE * PAGE,
                           "the history loaded from disk")
            panel = app.query_one(PageGrid)
            await wait_for(pilot, lambda: any(p.startswith("disk ") and f"{disk(app)[1]:,} tok hit" in p
                                              for p in panel.header), "the KV pages panel's disk tier")
            # its bytes are the user's tier (other models' and checkouts' pages too), and it says so
            assert any(p.startswith("disk ") and " user-wide · " in p for p in panel.header), panel.header
            await type_and_send(pilot, "Goodnight.")
            await wait_for(pilot, lambda: last_reply(app).state == "done", "the next reply")
            assert (last_reply(app).cached_tokens or 0) >= (history[0] - 2 * PAGE) // PAGE * PAGE

    history: list[int] = []
    with start(address, model=str(long_ckpt), timeout=120, **options):
        asyncio.run(first_run())
    with start(address, model=str(long_ckpt), timeout=120, **options):
        asyncio.run(second_run())


def test_pages_past_the_staging_ring_are_written_as_it_drains(tmp_path):
    """A release of more pages than the staging ring holds (a long conversation's): the rest are written as the
    writer frees the ring, step by step, none lost, each file the pool's bytes; a flush at idle gets them all."""
    from engine.kv import PageAllocator, PrefixMatch, RadixCacheManager
    from engine.kv.disk import DiskTier, PageFile
    from engine.kv.pool import KVPool
    from engine.kv.tiers import KVTiers

    pool = KVPool(2, 40, 4, 1, 8, torch.float32, torch.device("cpu"))
    pool.buffer.normal_()
    fingerprint = bytes(range(16))
    disk = DiskTier(tmp_path, fingerprint, pool.page_shape, torch.float32, 1 << 30)
    tiers = KVTiers(pool, fingerprint, None, disk, staging_bytes=3 * pool.page_bytes)
    cache = RadixCacheManager(PageAllocator(40), 4, tiers)
    tokens, pages = list(range(100, 140)), cache.allocate(10, "r")
    cache.release(tokens, pages, PrefixMatch())
    assert disk.flush(10) and disk.pages == 3  # the ring's worth; the rest wait for room
    steps = 0
    while disk.pages < 10:
        cache.processed(steps)  # after each step: what the ring has room for now
        assert disk.flush(10)
        steps += 1
    assert steps == 3 and tiers.staging is not None and tiers.staging.used == 0
    parent = fingerprint
    for i, page in enumerate(pages):
        key = chain_key(parent, tuple(tokens[4 * i : 4 * i + 4]))
        data = disk.read(PageFile(fingerprint, key, parent, tuple(tokens[4 * i : 4 * i + 4]))).result()
        assert torch.equal(data, pool.read_pages([page])[0])
        parent = key
    more = cache.allocate(12, "s")  # a second release, flushed at idle at once
    cache.release(list(range(200, 248)), more, PrefixMatch())
    assert cache.flush(30) and disk.pages == 22
    cache.check_integrity(idle=True)
    disk.close(10)


def test_an_idle_engine_writes_what_waited_for_the_staging_ring(long_ckpt, tmp_path):
    """A served prompt of more pages than the staging ring holds (64 at least): the engine, idle after it, writes
    the rest as the ring drains without another request coming, and says meanwhile how many pages are on the way."""
    from engine.service.launcher import start

    prompt = ids(100 * PAGE + 1, 41)
    with start(f"ipc://{tmp_path}/engine.sock", model=str(long_ckpt), timeout=120, num_pages=1024,
               max_prefill_tokens=512, kv_cache_dir=str(tmp_path / "kv")) as handle, handle.client() as client:
        client.complete(prompt, greedy(2))
        stats = client.wait_stats(lambda s: not s.running and not s.waiting)
        (disk,) = stats.pages.tiers
        assert disk.pages + disk.writing >= 100 or disk.stored >= 100  # every full page written or on its way
        stats = client.wait_stats(lambda s: s.pages.tiers[0].pages >= 100 and not s.pages.tiers[0].writing, 60)
    assert len(page_files(tmp_path / "kv")) == stats.pages.tiers[0].pages >= 100
    assert all(path.exists() for path in page_paths(tmp_path / "kv", prompt))


def test_an_idle_disk_tier_scans_its_directory_only_when_it_changed(tmp_path):
    """An idle writer looks every RESCAN_EVERY seconds, but scans the directory (a stat a file: 215,000 files took
    5 s) only when one of its directories changed since the last scan: another engine wrote or deleted a file. It counts
that engine's file as its own is not, and leaves a file not named as a page alone."""
    from engine.kv.disk import DiskTier, PageFile

    shape, ours, theirs = (2, 1, 4, 1, 8), bytes(16), bytes(range(16))
    a = DiskTier(tmp_path, ours, shape, torch.float32, 1 << 30)
    b = DiskTier(tmp_path, theirs, shape, torch.float32, 1 << 30)
    stray = tmp_path / ours.hex() / "notes.kv"  # not named as a page file: neither counted nor deleted
    stray.write_text("a user's file")
    a.rescan()
    assert a._stamp() == a._scanned_stamp  # nothing changed: no scan due
    key = chain_key(theirs, (1, 2, 3, 4))
    assert b.write(PageFile(theirs, key, theirs, (1, 2, 3, 4)), torch.zeros(shape), lambda: None) and b.flush(10)
    assert a._stamp() != a._scanned_stamp  # the other engine's file: a scan is due
    a.rescan()
    assert a._stamp() == a._scanned_stamp and a.total_bytes == b.total_bytes > 0
    assert (a.pages, b.pages) == (0, 1) and key not in a and key in b and stray.exists()
    a.check_integrity()
    a.close(10)
    b.close(10)


def test_a_script_that_simply_ends_exits_cleanly_with_its_pages_written(tmp_path):
    """A script that uses `LLM` and ends without `close()` (as most do): its engine is closed at exit (atexit), so no
    tier thread is still inside torch or a file write while the interpreter finalises (that aborted such scripts,
    exit 134, one run in three on another machine), and the pages queued for disk are all there, as after an
    explicit close. Without the exit hook the daemon writer died with its queue (142-239 of 444 pages written, with
    12 prompts)."""
    script = textwrap.dedent("""
        import random, sys
        from engine import LLM, SamplingParams
        llm = LLM(None, kv_cache_dir=sys.argv[1])
        rng = random.Random(7)
        prompts = [[rng.randrange(5, 400) for _ in range(400)] for _ in range(8)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        if sys.argv[2] == "close":
            llm.close()
        """)

    def pages_after(how: str, where: Path) -> int:
        done = subprocess.run([sys.executable, "-c", script, str(where), how], capture_output=True, text=True,
                              timeout=300, cwd=Path(__file__).parent.parent, env=os.environ | {"PYTHONPATH": "."})
        assert done.returncode == 0 and "terminate called" not in done.stderr, (done.returncode, done.stderr[-3000:])
        return len(page_files(where))

    closed = pages_after("close", tmp_path / "closed")
    assert closed > 100
    assert [pages_after("end", tmp_path / f"ended-{i}") for i in range(2)] == [closed, closed]
