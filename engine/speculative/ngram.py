"""Prompt lookup: propose what followed the last time a request's own text ended the way it ends now.

Chat repeats its context (a quoted paragraph, code being edited, JSON keys, a summary's names), and there
the tokens after the latest earlier occurrence of the last n tokens are a good guess at the next ones,
for free: no model runs. The index keeps, for every n in [n_min, n_max], each n-gram of the request's
prompt and output with where its latest occurrence ends, added as tokens arrive (O(n_max) per token), so
a lookup is a dict access per n, longest first. The latest occurrence is preferred to the first: in an
edit or a continuation it is the one most like what comes next (llama.cpp's and vLLM's prompt lookup
take the first or score several; this one is measured in docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Req

Tokens = Callable[[int, int], list[int]]
"""A request's token ids at positions [start, end) of prompt + output (Req.tokens)."""


class NgramIndex:
    """One request's n-grams -> where their latest occurrence ends (exclusive), for n in [n_min, n_max].

    Every n-gram ending before the current end is indexed; the one ending at the end (the suffix being
    looked up) is added at the next lookup, so a suffix never matches itself."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self._indexed = 0  # n-grams ending at positions < this are in `_ends`

    def propose(self, tokens: Tokens, length: int, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the sequence's last n tokens (the
        longest n that occurs); [] when none does. `tokens` reads the sequence, `length` is its length."""
        self._index(tokens, length)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            end = self._ends[n].get(tuple(tokens(length - n, length)))
            if end is not None:
                return tokens(end, min(end + k, length))
        return []

    def _index(self, tokens: Tokens, length: int) -> None:
        """Add the n-grams ending at positions [indexed, length) -- all but the suffix ending at `length`."""
        first = max(self._indexed, self.n_min)
        if first >= length:
            return
        start = max(0, first - self.n_max)
        window = tokens(start, length - 1)
        for end in range(first, length):
            for n, ends in self._ends.items():
                if end - n >= start:
                    ends[tuple(window[end - n - start : end - start])] = end
        self._indexed = length


class NgramProposer:
    """Prompt lookup for every request slot: an index per slot, built as its request's tokens arrive and
    dropped with its slot. `lookahead` looks the proposal up; `propose` hands out as much of it as asked."""

    pass_costs = None  # no model runs

    def __init__(self, slots: int, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._indexes: list[NgramIndex | None] = [None] * slots
        self._found: dict[int, list[int]] = {}  # this step's proposals by slot, between lookahead and propose

    def feeds(self, req: Req) -> int:
        return 0

    def lookahead(self, req: Req, most: int) -> int:
        assert req.kv.slot is not None
        index = self._indexes[req.kv.slot]
        if index is None:
            index = self._indexes[req.kv.slot] = NgramIndex(self.n_min, self.n_max)
        found = index.propose(req.tokens, req.total_len, most)
        if found:
            self._found[req.kv.slot] = found
        return len(found)

    def propose(self, counts: dict[Req, int]) -> dict[Req, list[int]]:
        found, self._found = self._found, {}
        return {req: found[req.kv.slot][:n] for req, n in counts.items() if req.kv.slot is not None and n}

    def keep(self, req: Req, count: int) -> None:
        pass

    def verified(self, req: Req) -> None:
        pass

    def release(self, req: Req) -> None:
        if req.kv.slot is not None:
            self._indexes[req.kv.slot] = None
