"""A draft model: a small model with the target's tokenizer, run greedily to propose the next tokens.

It has its own KV pool and request table, and no scheduler: its table's rows are the target's request
slots, and each proposal first feeds the draft what it has not seen of the request (the prompt the first
time, then the tokens verification accepted since) in one ragged forward, then one forward per further
draft position for all drafting requests together. Its proposals are greedy (one-hot), which is what
makes verification by plain sampling exact (engine/speculative/speculator.py). A request's draft K/V is kept
up to the tokens verification confirmed (`verified`) and dropped when the target releases the request
(`release`), so a retracted request catches up again from its prompt.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.kv.allocator import PageAllocator
from engine.kv.pool import KVPool
from engine.kv.table import RequestTable
from engine.model.decoder import CausalLM
from engine.pages import pages_for
from engine.sampling import greedy_tokens
from engine.speculative.policy import StepCosts
from kernels.attention.base import AttentionBackend, build_metadata

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.request import Req

PASS_RECOVER = 0.02  # per step without a pass, the estimates fall by this share: a slow pass is tried again later


class DraftModel:
    """Proposes up to k tokens per request, greedily, from a model of its own. `vocab_size`: the target's; a
    draft token at or beyond it ends the proposal (a draft vocabulary may be padded wider)."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, num_pages: int, page_size: int, slots: int,
                 max_len: int, device: torch.device, vocab_size: int, max_chunk: int) -> None:
        spec = model.spec
        self.model, self.backend, self.page_size = model, backend, page_size
        self.kv = KVPool(spec.num_layers, num_pages, page_size, model.num_kv_heads, spec.head_dim,
                         model.norm.weight.dtype, device)
        self.table = RequestTable(slots, max_len, device)
        self.allocator = PageAllocator(num_pages)
        self.vocab_size = vocab_size
        self.max_chunk = max_chunk  # catch-up tokens per forward (a long prompt is fed in several)
        self.known = [0] * slots  # per request slot: tokens whose draft K/V are stored
        self.pages: list[list[int]] = [[] for _ in range(slots)]
        self.pass_costs = StepCosts(first=0.0)  # one forward of a draft position, by the requests it carries

    def lookahead(self, req: Req, most: int) -> int:
        """Drafts it could propose for `req` now: any number, as long as its pages fit the draft pool."""
        assert req.kv.slot is not None
        short = pages_for(req.total_len + most - 1, self.page_size) - len(self.pages[req.kv.slot])
        return most if short <= self.allocator.num_free else 0

    def feeds(self, req: Req) -> int:
        """The tokens `_catch_up` feeds for `req`: those it has not seen, and its last one again."""
        assert req.kv.slot is not None
        return req.total_len - min(self.known[req.kv.slot], req.total_len - 1)

    def propose(self, counts: dict[Req, int]) -> dict[Req, list[int]]:
        """`counts[req]` greedy drafts for each request (all of them processed: every token is known). A step
        without any lets the pass times' estimates fall a little (PASS_RECOVER): one slow pass (the machine was
        busy) would otherwise price drafting out for good, since only passes measure it."""
        if not counts:
            self.pass_costs.fade(PASS_RECOVER)
            return {}
        reqs = list(counts)
        for req in reqs:
            self._reserve(req, req.total_len + counts[req] - 1)
        drafts: dict[Req, list[int]] = {req: [] for req in reqs}
        token = self._catch_up(reqs)  # each request's next draft, fed to the model below if it wants more
        live = reqs
        for position in range(max(counts.values(), default=0)):
            more = []
            for req in live:
                if token[req] < self.vocab_size:
                    drafts[req].append(token[req])
                    if len(drafts[req]) < counts[req]:
                        more.append(req)
            if not more:
                break
            token = self._forward({r: [drafts[r][-1]] for r in more}, {r: r.total_len + position for r in more})
            live = more
        for req in reqs:  # fed: the sequence, and every draft but the last
            assert req.kv.slot is not None
            self.known[req.kv.slot] = req.total_len + max(0, len(drafts[req]) - 1)
        return {r: d for r, d in drafts.items() if d}

    def keep(self, req: Req, count: int) -> None:
        """Only the first `count` drafts of `req`'s proposal go to verification: the draft K/V of the ones after
        (fed as if they were the sequence) is not to be trusted."""
        assert req.kv.slot is not None
        self.known[req.kv.slot] = min(self.known[req.kv.slot], req.total_len + max(0, count - 1))

    def verified(self, req: Req) -> None:
        """After verification: the draft K/V is right up to the target's (positions < cached_len)."""
        assert req.kv.slot is not None
        self.known[req.kv.slot] = min(self.known[req.kv.slot], req.cached_len)

    def release(self, req: Req) -> None:
        """The target gives up `req`'s slot: its draft K/V goes too."""
        if req.kv.slot is None:
            return
        self.allocator.free(self.pages[req.kv.slot])
        self.pages[req.kv.slot], self.known[req.kv.slot] = [], 0

    def _reserve(self, req: Req, positions: int) -> None:
        assert req.kv.slot is not None
        have = self.pages[req.kv.slot]
        need = pages_for(positions, self.page_size) - len(have)
        if need > 0:
            new = self.allocator.allocate(need, req.rid)
            self.table.write_pages(req.kv.slot, len(have), new, self.page_size)
            have += new

    def _catch_up(self, reqs: list[Req]) -> dict[Req, int]:
        """Feed each request's unseen tokens, up to its last one, at most `max_chunk` a forward; the greedy
        token after each (its first draft)."""
        firsts: dict[Req, int] = {}
        # the last token is always fed again (its logits give the first draft; its K/V are overwritten alike)
        fed = {r: min(self.known[r.kv.slot], r.total_len - 1) for r in reqs if r.kv.slot is not None}
        while fed:
            budget, chunk = self.max_chunk, {}
            for req, done in fed.items():
                chunk[req] = req.tokens(done, done + min(req.total_len - done, max(1, budget)))
                budget -= len(chunk[req])
            for req, token in self._forward(chunk, fed).items():
                fed[req] += len(chunk[req])
                if fed[req] == req.total_len:
                    firsts[req] = token
                    del fed[req]
        return firsts

    def _forward(self, ids: dict[Req, list[int]], starts: dict[Req, int]) -> dict[Req, int]:
        """One draft forward of each request's `ids` at positions from `starts[req]`: its greedy next token. A
        forward feeding at most two tokens a request is a draft pass, timed into `pass_costs`."""
        began = time.perf_counter()
        reqs = list(ids)
        device = self.table.table.device
        q_lens = [len(ids[r]) for r in reqs]
        kv_lens = [starts[r] + len(ids[r]) for r in reqs]
        flat = torch.tensor([t for r in reqs for t in ids[r]], dtype=torch.int64, device=device)
        positions = torch.tensor([p for r in reqs for p in range(starts[r], starts[r] + len(ids[r]))],
                                 dtype=torch.int64, device=device)
        rows = torch.tensor([r.kv.slot for r in reqs], dtype=torch.int64, device=device)
        ends = torch.tensor(q_lens, dtype=torch.int64, device=device).cumsum(0) - 1
        meta = self.backend.prepare(build_metadata(q_lens, kv_lens, rows, self.table.table))
        logits = self.model(flat, positions, ends, self.kv, self.backend, meta)
        assert logits is not None  # one rank: a draft model is never split
        tokens = dict(zip(reqs, greedy_tokens(logits).tolist(), strict=True))
        if max(q_lens) <= 2:
            self.pass_costs.record(len(reqs), time.perf_counter() - began)
        return tokens


def check_same_tokens(target: PreTrainedTokenizerBase | None, draft: PreTrainedTokenizerBase | None,
                      target_vocab: int, draft_vocab: int) -> None:
    """Raise ValueError unless a draft model's token ids mean what the target's do: the same vocabulary (or,
    where a checkpoint ships no tokenizer, the same vocabulary size)."""
    if target is not None and draft is not None:
        ours, theirs = target.get_vocab(), draft.get_vocab()
        if ours != theirs:
            differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
            raise ValueError(f"the draft model's tokenizer differs from the target's ({len(theirs)} vs {len(ours)} "
                             f"tokens; e.g. {differ}): a draft model must share the target's tokenizer")
    elif target_vocab != draft_vocab:
        raise ValueError(f"the draft model's vocabulary has {draft_vocab} ids and the target's {target_vocab}; "
                         "without tokenizers to compare, a draft model must have the target's vocabulary size")
