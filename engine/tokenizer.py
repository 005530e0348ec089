"""Tokenizer glue: the HF tokenizer, chat templates, EOS ids and a streaming detokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

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


def apply_chat_template(tokenizer: PreTrainedTokenizerBase | None, messages: list[dict[str, str]]) -> list[int]:
    """Render chat messages with the model's own template, ready for the assistant's turn."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer; send prompt token ids instead of chat messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each chat message must be {'role': str, 'content': str}")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces without splitting multi-byte characters.

    `tokenizers.DecodeStream` already holds back bytes until they form whole characters; on top of
    it we watch for stop strings and hold back any tail that could still grow into one, so streamed
    text never has to be taken back.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: list[str] | None) -> None:
        self._backend = tokenizer.backend_tokenizer if tokenizer is not None else None
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        self.stop = stop or []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> None:
        """Feed one token; sets `stopped` (and truncates the text) when a stop string appears."""
        if self._stream is None or self.stopped:
            return
        piece = self._stream.step(self._backend, token_id)
        if not piece:
            return
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += piece
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """Text not yet emitted; unless final, keeps back a tail that may be the start of a stop string."""
        end = len(self.text)
        if not final and not self.stopped:
            for s in self.stop:
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        piece = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return piece
