"""Tokenizer glue: the HF tokenizer, chat templates, EOS ids and a streaming detokenizer."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.prompt import check_template_kwargs
from engine.reasoning import Part

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None when it ships none (then prompts must be token ids)."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(path: Path, tokenizer: PreTrainedTokenizerBase | None, hf_config: object) -> set[int]:
    """The union of the tokenizer's EOS, the config's and generation_config.json's (often a list)."""
    ids: set[int] = set()

    def add(value: object) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    add(getattr(hf_config, "eos_token_id", None))
    gen = path / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    return ids


def has_chat_template(tokenizer: PreTrainedTokenizerBase | None) -> bool:
    """Whether chat messages can be rendered (a base model's tokenizer often has no template: plain prompts)."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def apply_chat_template(tokenizer: PreTrainedTokenizerBase | None, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True, *,
                        tools: Sequence[Mapping[str, Any]] | None = None,
                        template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Render chat messages with the model's own template, ready for the assistant's turn (unless
    `add_generation_prompt` is off: then just the conversation, as a token count of it wants).

    `tools` (OpenAI function tools) reach the templates that take them; engine/tools.py says which do
    (`tool_format`) and shapes messages that carry tool calls for them (`template_messages`).
    `template_kwargs` are more variables for the template (`enable_thinking` for Qwen3's)."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer; send prompt token ids instead of chat messages")
    if not has_chat_template(tokenizer):
        raise ValueError("this model has no chat template (a base model): send it a plain prompt instead (over "
                         "HTTP: /v1/completions)")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each chat message must be {'role': str, 'content': str}")
    check_template_kwargs(template_kwargs)
    try:
        out = tokenizer.apply_chat_template(messages, tools=None if tools is None else [dict(t) for t in tools],
                                            add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **dict(template_kwargs or {}))
    except Exception as e:  # a template may raise anything (jinja's TemplateError, KeyError) for roles it rejects
        raise ValueError(f"the model's chat template refused these messages: {type(e).__name__}: {e}") from e
    # token ids, in a BatchEncoding (or a dict) or as a list; transformers types the result for every set of flags
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return list(cast("list[int]", ids))


SYSTEM_PROBE = "minichat-system-probe"
USER_PROBE = "minichat-user-probe"


def takes_system_role(tokenizer: PreTrainedTokenizerBase | None) -> bool:
    """Whether the chat template renders a system message: some refuse one (Gemma's raises), some drop it
    without a word. A model without a template takes no chat at all, system or not (True: nothing to say)."""
    if tokenizer is None or not has_chat_template(tokenizer):
        return True
    chat = [{"role": "system", "content": SYSTEM_PROBE}, {"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    except Exception:  # a template may raise anything for a role it refuses (jinja's TemplateError, KeyError)
        return False
    return isinstance(text, str) and SYSTEM_PROBE in text


def default_system(tokenizer: PreTrainedTokenizerBase | None) -> str:
    """The system message the chat template adds when a chat has none (SmolLM2's "You are a helpful AI assistant
    named SmolLM, ..."), so that a console can say what the model actually sees; "" where it adds none. Read by
    rendering a chat with a probe system message and one without: where the second has text in the probe's
    place, between the same markers, that text is the default."""
    if tokenizer is None or not has_chat_template(tokenizer):
        return ""
    user = [{"role": "user", "content": USER_PROBE}]
    try:
        probed = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROBE}, *user],
                                               add_generation_prompt=True, tokenize=False)
        plain = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    except Exception:  # a template may raise anything for a role it refuses (jinja's TemplateError, KeyError)
        return ""
    if not isinstance(probed, str) or not isinstance(plain, str) or SYSTEM_PROBE not in probed:
        return ""
    before, after = probed.split(SYSTEM_PROBE, 1)
    tail = after[: after.find(USER_PROBE)] if USER_PROBE in after else after  # the system block's end, to the user's
    end = tail.rstrip()[:16] if tail.strip() else ""
    if not before or not plain.startswith(before) or not end:
        return ""
    text = plain[len(before):]
    return text[: text.find(end)].strip() if end in text else ""


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase | None, max_tokens: int) -> int:
    """A character count beyond which a text prompt surely tokenizes to more than `max_tokens` tokens:
    no token spells more characters than the vocabulary's longest entry (doubled, for normalizers that
    drop characters). Checked before tokenizing, so an oversized prompt is refused at no cost."""
    if tokenizer is None:
        return 0
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 2 * max(longest, 1) * max_tokens


class StopMatcher:
    """Aho-Corasick automaton over the stop strings: text is fed once, so the cost per step is
    proportional to the new text, not to the number or length of the stop strings.

    `held` is the length of the longest tail of the text so far that could still grow into a stop
    string (the automaton's depth), which the detokenizer holds back from the stream."""

    def __init__(self, stops: list[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._match = [0]  # length of the longest stop string ending at this node (0: none)
        for s in stops:
            node = 0
            for ch in s:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    self._match.append(0)
                node = nxt
            self._match[node] = max(self._match[node], len(s))
        self._fail = [0] * len(self._goto)
        queue = list(self._goto[0].values())
        for node in queue:  # breadth first: a node's failure link is settled before its children's
            for ch, child in self._goto[node].items():
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                link = self._goto[f].get(ch, 0)
                self._fail[child] = link if link != child else 0
                self._match[child] = max(self._match[child], self._match[self._fail[child]])
                queue.append(child)
        self._state = 0

    @property
    def held(self) -> int:
        return self._depth[self._state]

    def feed(self, text: str, offset: int) -> int | None:
        """Advance over `text` (which starts at `offset` in the whole text); the earliest start of a stop
        string that ends inside it, or None."""
        earliest = None
        goto, fail, match = self._goto, self._fail, self._match
        state = self._state
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if match[state]:
                start = offset + i + 1 - match[state]  # the longest one ending here starts earliest
                earliest = start if earliest is None else min(earliest, start)
        self._state = state
        return earliest


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces without splitting multi-byte characters.

    `tokenizers.DecodeStream` already holds back bytes until they form whole characters; on top of
    it we watch for stop strings and hold back any tail that could still grow into one, so streamed
    text never has to be taken back. A reply with a think block (engine/reasoning.py) has its thinking
    kept apart (`reasoning`, taken with `take_reasoning`) and its markers dropped; stop strings are
    looked for in the answer only.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: list[str] | None) -> None:
        backend = tokenizer.backend_tokenizer if tokenizer is not None else None
        # the fast tokenizer with its decoding state; None without a tokenizer (no text then)
        self._decoder = (backend, DecodeStream(skip_special_tokens=True)) if backend is not None else None
        self.stop = stop or []
        self._matcher = StopMatcher(self.stop) if self.stop else None
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped it
        self.reasoning = ""
        self._reasoning_emitted = 0

    def add(self, token_id: int, part: Part = Part.ANSWER) -> None:
        """Feed one token (`part`: where in the reply it is); sets `stopped` (and truncates the text) when
        a stop string appears."""
        if self._decoder is None or self.stopped:
            return
        backend, stream = self._decoder
        piece = stream.step(backend, token_id)
        if not piece:
            return
        if part is Part.MARKER:  # dropped, but not the bytes of thinking it completed (as "\ufffd" if cut)
            marker = backend.id_to_token(token_id) or ""
            self.reasoning += piece[:-len(marker)] if marker and piece.endswith(marker) else ""
            return
        if part is Part.THINKING:
            self.reasoning += piece
            return
        offset = len(self.text)
        self.text += piece
        hit = self._matcher.feed(piece, offset) if self._matcher is not None else None
        if hit is not None:
            self.matched = next(stop for stop in self.stop if self.text.startswith(stop, hit))
            self.text = self.text[:hit]
            self.stopped = True

    def take(self, final: bool) -> str:
        """Text not yet emitted; unless final, keeps back a tail that may be the start of a stop string."""
        end = len(self.text)
        if not final and not self.stopped and self._matcher is not None:
            end -= self._matcher.held
        piece = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return piece

    def take_reasoning(self) -> str:
        """Thinking not yet taken (nothing of it is held back: stop strings are the answer's)."""
        piece = self.reasoning[self._reasoning_emitted:]
        self._reasoning_emitted = len(self.reasoning)
        return piece
