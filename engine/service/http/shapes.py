"""How chat and completions dress a choice (reply.py's `Piece` and `Whole`): their object names, a whole
choice, a streamed piece of one, and log-probabilities (chat's `content` list, completions' legacy columns).
Chat shows a reply's thinking as vLLM, SGLang and llama.cpp do: `reasoning_content` beside `content`, in
the message and in the deltas."""

from __future__ import annotations

from typing import Any

from engine.outputs import TokenLogprob
from engine.service.http.reply import Piece, Whole


class Shape:
    """How an endpoint dresses outputs as choices: its object names, a whole choice, a streamed piece, and
    log-probabilities (`entries`; None: not asked for)."""

    endpoint = ""  # the metrics label
    id_prefix = ""
    object = ""
    chunk_object = ""

    def choice(self, index: int, whole: Whole, reasoning: bool) -> dict[str, Any]:
        """A whole choice (`reasoning`: the request split the thinking off)."""
        raise NotImplementedError

    def delta(self, index: int, piece: Piece) -> dict[str, Any]:
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

    def choice(self, index: int, whole: Whole, reasoning: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": whole.text}
        if reasoning:
            message["reasoning_content"] = whole.reasoning or None
        if whole.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in whole.tool_calls]
        return {"index": index, "message": message, "logprobs": self.logprobs(whole.logprobs),
                "finish_reason": whole.finish_reason}

    def delta(self, index: int, piece: Piece) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.text:
            delta["content"] = piece.text
        if piece.tool_calls:
            delta["tool_calls"] = [d.to_openai() for d in piece.tool_calls]
        return {"index": index, "delta": delta, "logprobs": self.logprobs(piece.logprobs),
                "finish_reason": piece.finish_reason}

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

    def choice(self, index: int, whole: Whole, reasoning: bool) -> dict[str, Any]:
        return self.delta(index, Piece(text=whole.text or "", logprobs=whole.logprobs,
                                       finish_reason=whole.finish_reason))

    def delta(self, index: int, piece: Piece) -> dict[str, Any]:
        return {"index": index, "text": piece.text, "logprobs": self.logprobs(piece.logprobs, piece.offset),
                "finish_reason": piece.finish_reason}


CHAT, COMPLETION = ChatShape(), CompletionShape()
