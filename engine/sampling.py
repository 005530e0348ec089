"""Token sampling for the whole batch at once, on the logits' device, with no host sync and no loop
over requests: the logits processors, the draw and the log-probabilities are batched tensor ops.

The scheduler builds a `SamplingBatch` for each step on the host (`SamplingBatch.build`): one value
per sampled row for each parameter, and only the parts some row uses (an all-greedy batch without
processors is one argmax). `sample` applies the processors in vLLM's order (see SamplingParams),
then draws each row's token by inverse transform: one uniform number per row, the token whose
cumulative probability first exceeds it. The number is a hash of the request's seed and the position
being sampled, computed on the host, so a seeded request draws the same tokens whatever else shares
its batch, on any device, after a retraction, and with no per-request generator.

Penalties read the request's own tokens from the request table's token ids on the device (the runner
writes prompt tokens there, the sampler its output), so they work under overlap, where the host has
not yet seen the previous token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.params import SamplingParams
from engine.reasoning import ThinkBlock
from engine.request import Req
from engine.structured import GrammarMatcher, apply_bitmask, fill_bitmask

# Below this, logits / temperature overflows float32 (a temperature of 1e-40 made every logit inf);
# sampling that cold is greedy in all but name.
MIN_TEMPERATURE = 1e-6
TOP_K_OFF = 2**62  # a top_k beyond any vocabulary
_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers whose output bits all depend on every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that decides the token a request with `seed` samples at `position`."""
    z = _mix64(_mix64(seed & _MASK64) ^ ((position + 1) * 0x9E3779B97F4A7C15 & _MASK64))
    return (z >> 11) * 2.0**-53


@dataclass
class Penalties:
    """Rows (of the sampled rows) with a penalty, the request-table rows holding their tokens, where
    their prompts end and how many tokens they have, and the three penalties."""

    rows: torch.Tensor  # int64 [P]
    slots: torch.Tensor  # int64 [P]
    prompt_lens: torch.Tensor  # int64 [P]
    lengths: torch.Tensor  # int64 [P]
    width: int  # max(lengths): the token-table columns to read
    presence: torch.Tensor  # float32 [P, 1]
    frequency: torch.Tensor
    repetition: torch.Tensor


@dataclass
class PromptLogprobs:
    """Prompt positions whose logits follow the sampled rows' in the runner's logits (rows S..S+P-1):
    the prompt token each position predicts, and the most alternatives any of them wants."""

    targets: torch.Tensor  # int64 [P]
    top: int


@dataclass
class Grammars:
    """The rows' grammar matchers (None: unconstrained, or filled already) and the step's token bitmask.
    `ready` returns once the previous step's tokens are accepted into the matchers: under overlap this
    step was scheduled before they were known, so the mask is filled at sampling time, while the host
    processes the previous step and the model runs this one. `filled` rows were filled when the batch
    was built: a request verifying drafts has nothing in flight, and its rows follow the drafts."""

    matchers: list[GrammarMatcher | None]
    bitmask: torch.Tensor  # int32 [S, ceil(vocab / 32)], on the host
    ready: Callable[[], None]
    filled: list[int] = field(default_factory=list)

    def apply(self, logits: torch.Tensor) -> None:
        self.ready()
        rows = fill_bitmask(self.bitmask, self.matchers) + self.filled
        apply_bitmask(logits, self.bitmask, sorted(rows))


@dataclass
class Forcing:
    """Rows (of the sampled rows) whose request may have to emit a given token next: a think block's close
    once its budget is spent (engine/reasoning.py). Which do, and what, is known only once the previous
    step's tokens are processed (`ready`, as for grammars); a forced row's other tokens are masked, so
    whatever the processors and the draw do, it samples that token (its raw logprobs stay the model's)."""

    rows: list[tuple[int, ThinkBlock]]
    ready: Callable[[], None]

    def apply(self, logits: torch.Tensor) -> None:
        self.ready()
        for row, block in self.rows:
            token = block.forced()
            if token is not None:
                logits[row] = float("-inf")
                logits[row, token] = 0.0


@dataclass
class SamplingBatch:
    """Everything `sample` needs for one step's sampled rows, as tensors on the model's device.

    `params` stays for the host (the process step reads the requests themselves); a field is None
    when no row needs it, so the common batch pays only for what it uses."""

    params: list[SamplingParams]
    greedy_only: bool = True  # every row greedy and no processor: one argmax
    greedy: torch.Tensor | None = None  # bool [S]
    temperature: torch.Tensor | None = None  # float32 [S, 1]; 1 on greedy rows
    uniform: torch.Tensor | None = None  # float32 [S, 1]: each row's draw
    top_k: torch.Tensor | None = None  # int64 [S, 1]; vocab size where off
    top_p: torch.Tensor | None = None  # float32 [S, 1]
    min_p: torch.Tensor | None = None  # float32 [S, 1]
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, biases
    ban: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, token ids: masked (min_tokens)
    penalties: Penalties | None = None
    logprobs: tuple[torch.Tensor, int] | None = None  # rows wanting them, most alternatives asked
    logprob_rows: list[int] | None = None  # the same rows, on the host
    prompt_logprobs: PromptLogprobs | None = None
    grammars: Grammars | None = None
    forcing: Forcing | None = None

    @classmethod
    def build(cls, reqs: Sequence[Req], eos_ids: set[int], device: torch.device,
              prompt_targets: list[int] | None = None, prompt_top: int = 0,
              offsets: Sequence[int] | None = None) -> SamplingBatch:
        """The batch for sampled rows of requests `reqs` (scheduled, their `sampled` not yet counted), and the
        prompt tokens whose log-probabilities the step's extra logits rows predict. Row i samples the output
        token `offsets[i]` past its request's `sampled` (0 but for a request verifying drafts, whose rows
        sample as if its drafts before them had been accepted)."""
        params = [r.params for r in reqs]
        ahead = list(offsets) if offsets is not None else [0] * len(reqs)
        batch = cls(params)
        if prompt_targets:
            batch.prompt_logprobs = PromptLogprobs(torch.tensor(prompt_targets, device=device), prompt_top)
        wants = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wants:
            batch.logprobs = (torch.tensor(wants, device=device), max(params[i].logprobs or 0 for i in wants))
            batch.logprob_rows = wants
        processed = [p for p in params if not p.greedy or p.logit_bias or p.penalized
                     or p.min_tokens or p.min_p]
        if not processed:
            return batch
        batch.greedy_only = False
        floats = torch.tensor([[max(p.temperature, MIN_TEMPERATURE) if not p.greedy else 1.0, p.top_p, p.min_p,
                                draw(r.seed, r.input_len + r.sampled + a)]
                               for p, r, a in zip(params, reqs, ahead, strict=True)],
                              dtype=torch.float32).to(device, non_blocking=True)
        batch.temperature, top_p, min_p, batch.uniform = floats.split(1, dim=1)
        batch.greedy = torch.tensor([p.greedy for p in params]).to(device, non_blocking=True)
        if any(p.top_p < 1.0 for p in params):
            batch.top_p = top_p
        if any(p.min_p for p in params):
            batch.min_p = min_p
        if any(p.top_k > 0 for p in params):
            batch.top_k = torch.tensor([[p.top_k if p.top_k > 0 else TOP_K_OFF] for p in params], device=device)
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        if bias:
            rows, tokens, values = zip(*bias, strict=True)
            batch.bias = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device),
                          torch.tensor(values, dtype=torch.float32, device=device))
        ban = [(i, t) for i, (p, r, a) in enumerate(zip(params, reqs, ahead, strict=True))
               if r.sampled + a < p.min_tokens
               for t in sorted((set() if p.ignore_eos else eos_ids) | set(p.stop_token_ids or ()))]
        if ban:
            rows, tokens = zip(*ban, strict=True)
            batch.ban = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:
            lens = [reqs[i].input_len + reqs[i].sampled + ahead[i] for i in penalized]
            table = torch.tensor([[i, reqs[i].kv.slot or 0, reqs[i].input_len, n] for i, n in zip(penalized, lens,
                                                                                           strict=True)],
                                 device=device)
            amounts = torch.tensor([[params[i].presence_penalty, params[i].frequency_penalty,
                                     params[i].repetition_penalty] for i in penalized], device=device)
            presence, frequency, repetition = amounts.split(1, dim=1)
            index, slots, prompt_lens, lengths = table.unbind(1)
            batch.penalties = Penalties(index, slots, prompt_lens, lengths, max(lens), presence, frequency, repetition)
        return batch


@dataclass
class Logprobs:
    """Log-probabilities for the rows that asked: the chosen token's and the top alternatives (ids and
    values), one row per asking sampled row, then one per prompt position."""

    chosen: torch.Tensor  # float32 [R]
    top_ids: torch.Tensor  # int64 [R, K]
    top_values: torch.Tensor  # float32 [R, K]

    def to_host(self) -> Logprobs:
        return Logprobs(*(t.to("cpu", non_blocking=True) for t in (self.chosen, self.top_ids, self.top_values)))


def apply_penalties(logits: torch.Tensor, pen: Penalties, token_ids: torch.Tensor) -> None:
    """Repetition (over prompt and output; divides a positive logit, multiplies a negative one),
    frequency (times the output count) and presence (once per output token seen), in place."""
    tokens = token_ids[pen.slots, : pen.width]  # [P, W]
    position = torch.arange(pen.width, device=logits.device)[None, :]
    known = position < pen.lengths[:, None]
    output = known & (position >= pen.prompt_lens[:, None])
    vocab = logits.shape[1]
    counts = torch.zeros(len(pen.rows), vocab, device=logits.device).scatter_add_(1, tokens, output.float())
    seen = torch.zeros(len(pen.rows), vocab, device=logits.device).scatter_add_(1, tokens, known.float()) > 0
    rows = logits[pen.rows]
    rows = torch.where(seen, torch.where(rows > 0, rows / pen.repetition, rows * pen.repetition), rows)
    rows = rows - pen.frequency * counts - pen.presence * (counts > 0).float()
    logits[pen.rows] = rows


def process_logits(logits: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor) -> torch.Tensor:
    """The logits every processor has shaped: min_tokens, logit_bias, penalties, temperature, min_p,
    top_k, top_p (masked tokens at -inf). The most likely token of each row always survives top-k,
    top-p and min_p, so every row can be sampled."""
    logits = logits.clone()
    if batch.ban is not None:
        logits[batch.ban] = float("-inf")
    if batch.bias is not None:
        rows, tokens, values = batch.bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    if batch.penalties is not None:
        apply_penalties(logits, batch.penalties, token_ids)
    assert batch.temperature is not None  # built with every processed batch
    logits = logits / batch.temperature
    if batch.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < batch.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if batch.top_k is not None or batch.top_p is not None:
        ordered, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(ordered, dtype=torch.bool)
        if batch.top_k is not None:
            drop |= torch.arange(logits.shape[1], device=logits.device)[None, :] >= batch.top_k
        if batch.top_p is not None:  # over what top-k kept, renormalised (as vLLM); the first token stays
            probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
            drop |= (torch.cumsum(probs, dim=-1) - probs) >= batch.top_p
        drop[:, 0] = False
        logits = logits.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    return logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit (a NaN counting as largest), as `argmax` gives it: torch 2.13's CPU `argmax`
    takes 372 us over Gemma 3's 262,144 logits where `max(dim)` takes 129 (same indices, ties and NaN included), a
    twentieth of a decode step of that model."""
    return torch.max(logits, dim=-1).indices


def sample(logits: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor) -> torch.Tensor:
    """One next token per sampled row of float32 `logits` [S, vocab] (int64, on the logits' device;
    the caller decides when to copy it). `token_ids` is the request table's token ids (penalties).

    A row that cannot be sampled (non-finite logits from a broken checkpoint, say) takes its argmax,
    so one request's failure never takes down the batch."""
    if batch.grammars is not None or batch.forcing is not None:  # on a copy: the caller's stay raw for logprobs
        logits = logits.clone()
        for mask in (batch.grammars, batch.forcing):
            if mask is not None:
                mask.apply(logits)
    if batch.greedy_only:
        return greedy_tokens(logits)
    shaped = process_logits(logits, batch, token_ids)
    best = greedy_tokens(shaped)
    assert batch.uniform is not None and batch.greedy is not None
    cdf = torch.cumsum(torch.softmax(shaped, dim=-1), dim=-1)
    total = cdf[:, -1:]
    drawn = torch.searchsorted(cdf, batch.uniform * total, right=True).squeeze(1).clamp_(max=logits.shape[1] - 1)
    usable = torch.isfinite(total).squeeze(1) & (total.squeeze(1) > 0) & ~batch.greedy
    return torch.where(usable, drawn, best)


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> Logprobs:
    """Log-softmax of raw `logits` rows: each row's `tokens` entry and its `top` most likely tokens."""
    lp = torch.log_softmax(logits, dim=-1)
    values, ids = lp.topk(top, dim=-1) if top else (lp[:, :0], tokens[:, None][:, :0])
    return Logprobs(lp.gather(1, tokens[:, None]).squeeze(1), ids, values)
