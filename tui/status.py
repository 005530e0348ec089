"""`minichat status` as text: a few lines by default, the request lists and the page map on request.

The page map alone is up to MAP_LINES lines (a large pool is summarised to fit), so printing it every
time pushed everything else off the screen; it and the per-request lines are asked for (`--pages`,
`--requests`).
"""

from __future__ import annotations

import math

from engine.pages import TierUse, cells, paint
from engine.service.protocol import Info, Pages, Stats

MAP_WIDTH = 64  # characters per line of the map
MAP_LINES = 64  # lines at most: a larger pool gets a character per several pages
RUNNING = ("request_slots", "attention_backend", "weights", "gemm", "cpu_kernels", "layers", "overlap", "speculative",
           "kv_tiers", "cuda_graph")
"""What `status` says of how the engine runs; --verbose adds the rest (threads, OpenMP's wait, oneDNN's caches)."""


def summary(stats: Stats, info: Info | None = None, verbose: bool = False) -> list[str]:
    """Who and where the engine is, its slots and queues, KV pages, admission, rates and totals."""
    c, p = stats.counters, stats.pages
    busy = sum(h is not None for h in stats.slots)
    head = f"model {stats.model}, up {stats.uptime:.1f}s"
    lines = [head]
    if info is not None:
        lines = [f"minichat {info.version} at {info.address} (pid {info.pid}): {head}, max {info.max_seq_len} tokens"]
        if info.model_info:
            lines.append("model: " + "; ".join(f"{k} {v}" for k, v in info.model_info.items()))
        running = {k: v for k, v in info.execution.items() if verbose or k in RUNNING}
        if running:
            lines.append("running: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in running.items()))
        if info.generation_defaults:
            lines.append("the model's sampling defaults: " + ", ".join(f"{k} {v:g}"
                                                                         for k, v in info.generation_defaults.items()))
        if not info.system_role:
            lines.append("its chat template takes no system message")
    return [
        *lines,
        f"request slots {busy}/{len(stats.slots)} busy; waiting {len(stats.waiting)}; running {len(stats.running)}",
        f"KV pages ({p.page_size} tokens each{pool_dtype(p)}): {p.free} free, {p.held} held, {p.cached} cached, "
        f"{p.locked} locked, {p.total} total ({p.total * p.page_size:,} tokens); {p.claimed} more counted for "
        f"admitted requests; "
        + "; ".join(kv_tiers(stats)),
        f"admission {stats.admission}; order {stats.policy}; {c.retractions} retractions",
        f"rates: prefill {c.prefill_tokens_per_s:.1f} tok/s, decode {c.decode_tokens_per_s:.1f} tok/s, "
        f"{c.steps_per_s:.1f} steps/s",
        f"totals: {c.submitted} submitted, {c.finished} finished, {c.aborted} aborted, {c.errors} errors, "
        f"{c.steps} steps ({c.prefill_tokens} prefill + {c.decode_tokens} decode tokens)",
        *([f"speculative: {c.spec_accepted_tokens} of {c.spec_draft_tokens} draft tokens accepted "
           f"({c.spec_acceptance:.0%}) in {c.spec_drafts} verifications, {c.spec_mean_accepted_length:.2f} tokens "
           f"each; now {c.spec_accepted_tokens_per_s:.1f} of {c.spec_draft_tokens_per_s:.1f} draft tok/s accepted"]
          if c.spec_drafts else []),
    ]


def size(n: float) -> str:
    """Bytes as a person reads them: 512 B, 98 MiB, 8.0 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def pool_dtype(p: Pages) -> str:
    """", int8 pages of 36 KiB": what the pool's pages hold and weigh, where the engine says."""
    return f", {p.dtype} pages of {size(p.page_bytes)}" if p.dtype and p.page_bytes else ""


def kv_tiers(stats: Stats, brief: bool = False) -> list[str]:
    """The KV tiers, pool first, one part each: what each holds, what it served (prompt tokens found there) and,
    below the pool, what went in and came back and what went wrong; `brief` for the console's KV pages panel."""
    c = stats.counters
    hits = {"host": c.hit_tokens_host, "disk": c.hit_tokens_disk}
    parts = [f"pool {c.hit_tokens_pool:,} tok hit" if brief else f"pool {c.hit_tokens_pool:,} tokens hit"]
    for tier in stats.pages.tiers:
        parts.append(tier_text(tier, hits.get(tier.name, 0), brief))
    if not stats.pages.tiers and not brief:
        parts.append("no tier below the pool")
    return parts


def tier_text(t: TierUse, hit: int, brief: bool) -> str:
    """One tier. Its pages are this model's; the disk tier's bytes are its directory's, which is the user's and
    holds other models' and other checkouts' pages too: `minichat status` says them apart, so the two figures do not
    seem to disagree."""
    own = t.pages * (t.capacity_bytes // t.capacity) if t.capacity else t.bytes
    others = t.bytes - own if t.bytes > own else 0
    if brief:  # the KV pages panel: its pages and bytes only (the two move at different moments; an idle panel
        # whose text followed their difference redrew for nothing); the bytes said to be the whole user's, which a
        # fresh start already shows
        text = f"{t.name} {t.pages:,}/{t.capacity:,} p · {size(t.bytes)} user-wide · {hit:,} tok hit"
    else:
        held = f"{size(own)}; {size(t.bytes)} of {size(t.capacity_bytes)} with other models' and checkouts' pages " \
               f"in this user's tier" if others else f"{size(t.bytes)} of {size(t.capacity_bytes)}"
        text = f"{t.name} {t.pages:,}/{t.capacity:,} pages of this model ({held}), {hit:,} tokens hit, " \
               f"{t.stored:,} pages in, {t.loaded:,} out"
    if t.loading:
        text += f" · {t.loading} loading" if brief else f", {t.loading} loading"
    if t.writing:
        text += f" · {t.writing} writing" if brief else f", {t.writing} being written"
    problems = [f"{n} {why}" for why, n in t.rejected.items()]
    if t.write_errors:
        problems.append(f"{t.write_errors} failed writes")
    if t.skipped:
        problems.append(f"{t.skipped} pages not stored")
    if problems:
        text += f" · {len(problems)} problems" if brief else " (" + ", ".join(problems) + ")"
    return text + (f"; {t.degraded}" if t.degraded and not brief else "")


def requests(stats: Stats) -> list[str]:
    """One line per waiting and running request, and the last steps."""
    lines = []
    if stats.waiting:
        lines.append("waiting queue (in admission order):")
        lines += [f"  {w.rid}  {w.prompt_tokens} prompt tokens, waited {w.waited:.2f}s, for {w.reason or '?'}"
                  for w in stats.waiting]
    if stats.running:
        lines.append("running set:")
        lines += [f"  slot {r.slot:>3}  {r.rid}  {r.state}: prefilled {r.prefilled}/{r.prompt_tokens}, "
                  f"generated {r.generated}/{r.max_tokens}, {r.pages} pages"
                  + (f", drafts {r.spec.accepted_tokens}/{r.spec.draft_tokens} accepted" if r.spec else "")
                  for r in stats.running]
    if stats.steps:
        lines.append("last steps:")
        lines += [f"  #{s.index} {s.kind:<7} {len(s.rids)} req, {s.num_tokens} tokens, {s.duration * 1e3:.1f} ms"
                  for s in stats.steps]
    return lines


def page_map(pages: Pages) -> list[str]:
    """The KV pages, MAP_WIDTH characters to a line: a character a page while they fit in MAP_LINES lines,
    else a character for each few pages, the state most of them are in."""
    per_char = max(1, math.ceil(pages.total / (MAP_WIDTH * MAP_LINES)))
    states, holders = paint(pages.total, pages.runs, pages.owners)
    line = "".join(state for state, _ in cells(states, holders, per_char))
    scale = f"1 character = {per_char} pages; " if per_char > 1 else ""
    return [f"page map ({scale}. free, R held, c cached, L locked):",
            *[f"  {line[i:i + MAP_WIDTH]}" for i in range(0, len(line), MAP_WIDTH)]]


def render(stats: Stats, info: Info | None, show_requests: bool = False, show_pages: bool = False,
           verbose: bool = False) -> str:
    lines = summary(stats, info, verbose)
    if show_requests:
        lines += requests(stats)
    if show_pages:
        lines += page_map(stats.pages)
    return "\n".join(lines)
