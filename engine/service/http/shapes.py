"""How each generation endpoint dresses a choice: its object names, a whole choice, a streamed piece of one,
and log-probabilities (chat's `content` list, completions' legacy columns)."""

from __future__ import annotations

from typing import Any

from engine.outputs import TokenLogprob


class Shape:
    """How an endpoint dresses outputs as choices: its object names, a whole choice, a streamed one, and
    log-probabilities (`entries`; None: not asked for). `offset` is where a piece's text starts in its
    choice's text (completions report it per token)."""

    endpoint = ""  # the metrics label
    id_prefix = ""
    object = ""
    chunk_object = ""

    def choice(self, index: int, text: str, finish_reason: str | None,
               entries: list[TokenLogprob] | None) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, index: int, text: str, finish_reason: str | None, entries: list[TokenLogprob] | None,
              offset: int = 0) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self, index: int) -> dict[str, Any] | None:
        """A streamed choice's first chunk, before any output."""
        return None


def _bytes(text: str) -> list[int]:
    return list(text.encode())


class ChatShape(Shape):
    endpoint, id_prefix, object, chunk_object = "chat", "chatcmpl", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        return {"content": [{"token": e.text, "logprob": e.logprob, "bytes": _bytes(e.text),
                             "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)} for _, t, v in e.top]}
                            for e in entries]}

    def choice(self, index: int, text: str, finish_reason: str | None,
               entries: list[TokenLogprob] | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": self.logprobs(entries),
                "finish_reason": finish_reason}

    def delta(self, index: int, text: str, finish_reason: str | None, entries: list[TokenLogprob] | None,
              offset: int = 0) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": self.logprobs(entries),
                "finish_reason": finish_reason}

    def opening(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


class CompletionShape(Shape):
    endpoint, id_prefix, object, chunk_object = "completions", "cmpl", "text_completion", "text_completion"

    @staticmethod
    def logprobs(entries: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
        """OpenAI's legacy columns; a prompt's first token has no logprob and no alternatives (null)."""
        if entries is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.text)
        return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else {t: v for _, t, v in e.top} for e in entries],
                "text_offset": offsets}

    def choice(self, index: int, text: str, finish_reason: str | None,
               entries: list[TokenLogprob] | None) -> dict[str, Any]:
        return self.delta(index, text, finish_reason, entries)

    def delta(self, index: int, text: str, finish_reason: str | None, entries: list[TokenLogprob] | None,
              offset: int = 0) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self.logprobs(entries, offset),
                "finish_reason": finish_reason}


CHAT, COMPLETION = ChatShape(), CompletionShape()
