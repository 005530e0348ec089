"""Reasoning models' think blocks (Qwen3's and DeepSeek-R1's `<think>...</think>`): which markers a model
uses, read off its own chat template and vocabulary, and one request's block as its tokens come.

A model thinks in a block its chat template knows: the template writes the markers (Qwen3's renders an
earlier turn's reasoning between them, DeepSeek-R1's opens the block in the generation prompt, Qwen3 with
`enable_thinking: false` writes an empty one there). `think_markers` finds them without a list of known
strings: the vocabulary's added tokens with "think" in their text that the template writes, a start and
the same text with one "/" more as its end (`<think>` / `</think>`, `<seed:think>` / `</seed:think>`,
`◁think▷` / `◁/think▷`). Each marker is one token, so the block is followed token by token (`ThinkBlock`)
and the engine splits the text exactly where the model switched.

Whether a reply starts inside the block is the prompt's to say: open when the prompt's last start marker
comes after its last end marker (DeepSeek-R1's prompt, or Qwen3-2507's); closed for good when the prompt
ends as the template ends a generation prompt with thinking off (Qwen3's `<think>\n\n</think>\n\n`:
`ThinkMarkers.closed`); else the reply's first token may open one (Qwen3 with thinking on writes `<think>`
itself, also after a tool result) and any other first token starts the answer. After the end marker
everything is the answer; a second `<think>` there is just text.

A budget (`thinking_token_budget`, `--reasoning-budget`) bounds the thinking: after that many tokens
inside the block the engine makes the request emit the template's own close (`ThinkMarkers.close`, e.g.
"\\n</think>": the whitespace the template writes before the end marker, then the marker) token by token
(`ThinkBlock.forced`, applied by the sampler as the only allowed token), and the answer follows.
No torch here.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class Part(enum.Enum):
    """What a reply's token is: inside the think block, one of its markers, or the answer."""

    THINKING = "thinking"
    MARKER = "marker"
    ANSWER = "answer"


@dataclass(frozen=True)
class ThinkMarkers:
    """A model's think block: its start and end markers (one token each), `close`, the tokens the engine
    emits to end a block whose budget is spent (the template's whitespace before the end marker, then the
    marker), and `closed`, how a generation prompt with thinking off ends (from the end marker on; None
    when the template has no such switch)."""

    start: str
    end: str
    start_id: int
    end_id: int
    close: tuple[int, ...]
    closed: tuple[int, ...] | None = None


def think_markers(tokenizer: PreTrainedTokenizerBase | None) -> ThinkMarkers | None:
    """The think block the tokenizer's chat template writes, or None (no template, no such block, or an
    ambiguous pair, which is logged)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("default")
    if tokenizer is None or not isinstance(template, str):
        return None
    vocab = tokenizer.get_added_vocab()
    written = {text: i for text, i in vocab.items() if "think" in text.lower() and text in template}
    pairs = [(s, e) for s in written for e in written if "/" in e and e.replace("/", "", 1) == s]
    if len(pairs) != 1:
        if pairs:
            log.warning("the chat template writes several think blocks (%s); reasoning is not split", pairs)
        return None
    start, end = pairs[0]
    close = tokenizer.encode(_lead(tokenizer, end) + end, add_special_tokens=False)
    if not close or close[-1] != written[end]:
        return None
    return ThinkMarkers(start, end, written[start], written[end], tuple(close), _closed(tokenizer, written[end]))


def _closed(tokenizer: PreTrainedTokenizerBase, end_id: int) -> tuple[int, ...] | None:
    """How the template ends a generation prompt with `enable_thinking` false, from its end marker on."""
    try:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], add_generation_prompt=True,
                                            tokenize=True, enable_thinking=False)
    except Exception:  # a template may refuse any conversation it was not written for
        return None
    tokens = cast("list[int]", list(ids["input_ids"] if isinstance(ids, Mapping) else ids))
    if end_id not in tokens:
        return None
    return tuple(tokens[len(tokens) - 1 - tokens[::-1].index(end_id):])


def _lead(tokenizer: PreTrainedTokenizerBase, end: str) -> str:
    """The whitespace the template writes between an earlier turn's reasoning and the end marker, found by
    rendering such a turn (Qwen3: "\\n"); "" for templates that drop earlier reasoning."""
    probe = "R3as0n1ng"
    turns = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": probe}]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # a template may refuse any conversation it was not written for
        return ""
    found = re.search(re.escape(probe) + r"(\s*)" + re.escape(end), text if isinstance(text, str) else "")
    return found.group(1) if found else ""


class ThinkBlock:
    """One reply's think block as its tokens come (`feed`, once per token, in order): which part each
    token is, how many tokens the block took (`tokens`, markers included), and, once `budget` tokens have
    been spent inside it, the close the request must emit next (`forced`)."""

    def __init__(self, markers: ThinkMarkers, prompt: list[int], budget: int | None) -> None:
        self.markers = markers
        self.budget = budget
        self.state = _start(prompt, markers)  # None: the reply's first token decides
        self.tokens = 0
        self._inside = 0  # tokens inside the block before the close began
        self._closing = 0  # tokens of the close emitted so far

    @property
    def answering(self) -> bool:
        """The block is over (or never began): what comes is the answer."""
        return self.state is Part.ANSWER

    @property
    def may_open(self) -> bool:
        """The reply has not started: its first token may open a block."""
        return self.state is None

    def feed(self, token: int) -> Part:
        """Advance over the reply's next token; which part of the reply it is."""
        m = self.markers
        if self.state is None:
            self.state = Part.THINKING if token == m.start_id else Part.ANSWER
            if self.state is Part.ANSWER:
                return Part.ANSWER
            self.tokens += 1
            return Part.MARKER
        if self.state is Part.ANSWER:
            return Part.ANSWER
        self.tokens += 1
        if token == m.end_id:
            self.state = Part.ANSWER
            return Part.MARKER
        if self._closing or self.spent:
            self._closing += 1
        else:
            self._inside += 1
        return Part.THINKING

    @property
    def spent(self) -> bool:
        """The budget is used up inside an open block."""
        return self.state is Part.THINKING and self.budget is not None and self._inside >= self.budget

    def forced(self) -> int | None:
        """The token the reply must have next: the close's next one once the budget is spent, else None."""
        if not self.spent or self._closing >= len(self.markers.close):
            return None
        return self.markers.close[self._closing]

    def may_force(self, index: int) -> bool:
        """Whether the reply's token `index` may be forced, as far as the tokens scheduled so far tell
        (cheap, and true only from the budget on, until the block is known to be over)."""
        return self.budget is not None and index >= self.budget and not self.answering


def _start(prompt: list[int], markers: ThinkMarkers) -> Part | None:
    """Where a reply to `prompt` starts: inside the block the prompt left open, in the answer when the
    prompt closed the block as a generation prompt with thinking off does, else undecided (None)."""
    closed = markers.closed
    if closed is not None and tuple(prompt[-len(closed):]) == closed:
        return Part.ANSWER
    for token in reversed(prompt):
        if token == markers.end_id:
            return None
        if token == markers.start_id:
            return Part.THINKING
    return None
