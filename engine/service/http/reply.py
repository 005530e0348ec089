"""One HTTP request's reply built from the engine's outputs: each choice has a writer whose `feed(output)`
gives the stream's pieces of that output and whose `finish()` gives the whole choice, so a stream sends
the pieces as they come and a whole reply is "feed everything, then finish"; the usage is summed beside.

Three kinds of choice: plain text; text after its echoed prompt (completions' `echo`); text read for
tool calls as it comes (chat with tools, engine/tools), whose reply ends with finish_reason "tool_calls"
when it made calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.outputs import Final, Output, TokenLogprob
from engine.service.http.shapes import Shape
from engine.tools import StreamDelta, ToolCallStreamParser, ToolFormat, assemble


class Tally:
    """The token usage of one HTTP request summed over its choices, as far as their outputs have come:
    completion tokens as they stream, each choice's exact numbers once its Final is in. Cached prompt
    tokens are known only from the Finals, so `prompt_tokens_details` waits for all of them."""

    def __init__(self, prompt_tokens: dict[int, int | None]) -> None:
        self.prompt = dict(prompt_tokens)  # by each engine request's first choice; None until its Final
        self.completion = dict.fromkeys(self.prompt, 0)
        self.cached: dict[int, int] = {}

    def add(self, index: int, out: Output) -> None:
        if isinstance(out, Final):
            u = out.usage
            self.prompt[index], self.completion[index], self.cached[index] = \
                u.prompt_tokens, u.completion_tokens, u.cached_tokens
        else:
            self.completion[index] += len(out.token_ids)

    def body(self) -> dict[str, Any]:
        prompt, completion = sum(n or 0 for n in self.prompt.values()), sum(self.completion.values())
        done = len(self.cached) == len(self.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())} if done else None}


@dataclass
class EchoedPrompt:
    """A prompt shown ahead of each of its choices (`echo`): its text, and its log-probabilities once the
    engine has sent them (with its request's first output; the first choice scores it for all)."""

    text: str
    logprobs: list[TokenLogprob] | None = None


class ChoiceWriter:
    """One choice as its endpoint shows it, fed the engine's outputs for it in order."""

    def __init__(self, shape: Shape, index: int) -> None:
        self.shape, self.index = shape, index
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None

    def feed(self, out: Output) -> list[dict[str, Any]]:
        """The stream's pieces of `out` (the finish reason comes in a piece of its own)."""
        raise NotImplementedError

    def finish(self) -> dict[str, Any]:
        """The whole choice, from everything fed."""
        raise NotImplementedError

    def _note(self, entries: list[TokenLogprob] | None, finish_reason: str | None) -> None:
        if entries is not None:
            self.logprobs = (self.logprobs or [])
            self.logprobs += entries
        self.finish_reason = finish_reason or self.finish_reason


class TextChoice(ChoiceWriter):
    """A choice that is the model's text as it comes (completions: with each piece's text offset)."""

    def __init__(self, shape: Shape, index: int) -> None:
        super().__init__(shape, index)
        self.text = ""

    def feed(self, out: Output) -> list[dict[str, Any]]:
        text, entries = self._shown(out)
        pieces = [self.shape.delta(self.index, text, None, entries, len(self.text))] if text or entries else []
        self.text += text
        self._note(entries, out.finish_reason)
        if out.finish_reason:
            pieces.append(self.shape.delta(self.index, "", out.finish_reason, None))
        return pieces

    def finish(self) -> dict[str, Any]:
        return self.shape.choice(self.index, self.text, self.finish_reason, self.logprobs)

    def _shown(self, out: Output) -> tuple[str, list[TokenLogprob] | None]:
        """The text and log-probabilities of `out` that the choice shows."""
        return out.text, out.logprobs


class EchoChoice(TextChoice):
    """A choice after its prompt: the prompt's text, and its log-probabilities when the engine has sent them
    by then, lead the choice's first piece."""

    def __init__(self, shape: Shape, index: int, prompt: EchoedPrompt) -> None:
        super().__init__(shape, index)
        self.prompt = prompt
        self._led = False

    def _shown(self, out: Output) -> tuple[str, list[TokenLogprob] | None]:
        if out.prompt_logprobs is not None:
            self.prompt.logprobs = out.prompt_logprobs
        if self._led:
            return out.text, out.logprobs
        self._led = True
        scored = self.prompt.logprobs
        return self.prompt.text + out.text, out.logprobs if scored is None else [*scored, *(out.logprobs or ())]


class ToolCallChoice(ChoiceWriter):
    """A chat choice read for tool calls as it comes: its pieces carry content and call deltas; the whole
    choice's message has `content` (None when the reply is only calls) and `tool_calls`."""

    def __init__(self, shape: Shape, index: int, fmt: ToolFormat) -> None:
        super().__init__(shape, index)
        self._parser = ToolCallStreamParser(fmt)
        self._parsed: list[StreamDelta] = []  # what the parser made of the text so far

    def feed(self, out: Output) -> list[dict[str, Any]]:
        self._note(out.logprobs, out.finish_reason)
        pieces = [self._piece(self._parser.feed(out.text), None, out.logprobs)] if out.text or out.logprobs else []
        if out.finish_reason:
            pieces.append(self._piece(self._parser.finish(), out.finish_reason, None))
        return pieces

    def finish(self) -> dict[str, Any]:
        content, calls = assemble(self._parsed)
        choice = self.shape.choice(self.index, content or "", _with_calls(self.finish_reason, bool(calls)),
                                   self.logprobs)
        choice["message"] |= {"content": content, "tool_calls": [call.to_openai() for call in calls]}
        return choice

    def _piece(self, parsed: StreamDelta, finish_reason: str | None,
               entries: list[TokenLogprob] | None) -> dict[str, Any]:
        self._parsed.append(parsed)
        delta: dict[str, Any] = {"content": parsed.content} if parsed.content else {}
        if parsed.tool_calls:
            delta["tool_calls"] = [d.to_openai() for d in parsed.tool_calls]
        choice = self.shape.delta(self.index, "", _with_calls(finish_reason, bool(self._parser.calls)), entries)
        return choice | {"delta": delta}


def _with_calls(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason for a reply that ended by itself after making tool calls."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


class Reply:
    """Every choice of one HTTP request, each with its writer (made at its first output), and the usage.
    Outputs come by engine request: `first` is the index of its first choice (its own `index` counts
    from there). `echo`: each echoed prompt's text by its first choice; `calls_in`: the tool-call format
    to read (chat with tools)."""

    def __init__(self, shape: Shape, prompt_tokens: dict[int, int | None], echo: dict[int, str],
                 calls_in: ToolFormat | None) -> None:
        self.shape = shape
        self.usage = Tally(prompt_tokens)
        self._prompts = {first: EchoedPrompt(text) for first, text in echo.items()}
        self._calls_in = calls_in
        self._choices: dict[int, ChoiceWriter] = {}

    def feed(self, first: int, out: Output) -> list[dict[str, Any]]:
        """The stream's pieces of `out`, an output of the engine request whose first choice is `first`."""
        self.usage.add(first, out)
        index = first + out.index
        if index not in self._choices:
            self._choices[index] = self._writer(first, index)
        return self._choices[index].feed(out)

    def finish(self) -> list[dict[str, Any]]:
        """Every choice whole, in index order."""
        return [self._choices[i].finish() for i in sorted(self._choices)]

    def _writer(self, first: int, index: int) -> ChoiceWriter:
        if first in self._prompts:
            return EchoChoice(self.shape, index, self._prompts[first])
        if self._calls_in is not None:
            return ToolCallChoice(self.shape, index, self._calls_in)
        return TextChoice(self.shape, index)
