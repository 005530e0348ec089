"""One HTTP request's reply built from the engine's outputs: each choice has a writer whose `feed(output)`
gives the pieces that output adds to the choice and whose `finish()` gives the whole choice, so a stream
sends the pieces as they come and a whole reply is "feed everything, then finish"; the usage is summed
beside. Pieces and whole choices are the same for every API (`Piece`, `Whole`): each endpoint dresses
them its own way (shapes.py for chat and completions, anthropic.py, responses.py).

Three kinds of choice: plain text; text after its echoed prompt (completions' `echo`); text read for
tool calls as it comes (chat with tools, engine/tools), whose reply ends with finish_reason "tool_calls"
when it made calls. Any of them carries the reply's thinking apart when the engine split it off
(`SamplingParams.reasoning`, engine/reasoning.py): the tool-call parser and the echo read the answer only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.outputs import Final, Output, TokenLogprob
from engine.tools import StreamDelta, ToolCall, ToolCallDelta, ToolCallStreamParser, ToolFormat, assemble


@dataclass
class Piece:
    """What one output adds to a choice: thinking, answer text (from character `offset` of the choice's
    text), tool-call deltas, the log-probabilities of its tokens, and the finish reason once it ends (with
    the stop string that ended it, if one did)."""

    reasoning: str = ""
    text: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    offset: int = 0
    stop_string: str | None = None

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.text or self.tool_calls or self.logprobs or self.finish_reason)


@dataclass
class Whole:
    """A whole choice: its thinking, its answer (None: only tool calls), the calls, log-probabilities, and
    why it ended ("stop", "length", "tool_calls", "abort"; `stop_string`: the stop string that ended it)."""

    reasoning: str
    text: str | None
    tool_calls: list[ToolCall]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_string: str | None = None


class Tally:
    """The token usage of one HTTP request summed over its choices, as far as their outputs have come:
    completion tokens as they stream, each choice's exact numbers once its Final is in. Cached prompt
    and reasoning tokens are known only from the Finals, so they wait for all of them."""

    def __init__(self, prompt_tokens: dict[int, int | None]) -> None:
        self.prompt = dict(prompt_tokens)  # by each engine request's first choice; None until its Final
        self.completion = dict.fromkeys(self.prompt, 0)
        self.cached: dict[int, int] = {}
        self.reasoning: dict[int, int] = {}

    def add(self, index: int, out: Output) -> None:
        if isinstance(out, Final):
            u = out.usage
            self.prompt[index], self.completion[index], self.cached[index], self.reasoning[index] = \
                u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.reasoning_tokens
        else:
            self.completion[index] += len(out.token_ids)

    @property
    def done(self) -> bool:
        """Every engine request's Final is in."""
        return len(self.cached) == len(self.prompt)

    @property
    def prompt_tokens(self) -> int:
        return sum(n or 0 for n in self.prompt.values())

    @property
    def completion_tokens(self) -> int:
        return sum(self.completion.values())

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    @property
    def reasoning_tokens(self) -> int:
        return sum(self.reasoning.values())

    def body(self, reasoning: bool = False) -> dict[str, Any]:
        """OpenAI's usage object (`reasoning`: with `completion_tokens_details.reasoning_tokens`)."""
        prompt, completion = self.prompt_tokens, self.completion_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens} if self.done else None}
        if reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens} if self.done else None
        return usage


@dataclass
class EchoedPrompt:
    """A prompt shown ahead of each of its choices (`echo`): its text, and its log-probabilities once the
    engine has sent them (with its request's first output; the first choice scores it for all)."""

    text: str
    logprobs: list[TokenLogprob] | None = None


class ChoiceWriter:
    """One choice, fed the engine's outputs for it in order."""

    def __init__(self) -> None:
        self.reasoning = ""
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.stop_string: str | None = None

    def feed(self, out: Output) -> list[Piece]:
        """The pieces `out` adds (the finish reason comes in a piece of its own)."""
        raise NotImplementedError

    def finish(self) -> Whole:
        """The whole choice, from everything fed."""
        raise NotImplementedError

    def _note(self, out: Output, entries: list[TokenLogprob] | None) -> None:
        self.reasoning += out.reasoning
        if entries is not None:
            self.logprobs = (self.logprobs or [])
            self.logprobs += entries
        self.finish_reason = out.finish_reason or self.finish_reason
        if isinstance(out, Final):
            self.stop_string = out.stop_string

    def _ending(self, finish_reason: str | None) -> Piece:
        """The piece that ends the choice."""
        return Piece(finish_reason=finish_reason, stop_string=self.stop_string)


class TextChoice(ChoiceWriter):
    """A choice that is the model's text as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def feed(self, out: Output) -> list[Piece]:
        text, entries = self._shown(out)
        piece = Piece(out.reasoning, text, logprobs=entries, offset=len(self.text))
        pieces = [] if piece.empty else [piece]
        self.text += text
        self._note(out, entries)
        if out.finish_reason:
            pieces.append(self._ending(out.finish_reason))
        return pieces

    def finish(self) -> Whole:
        return Whole(self.reasoning, self.text, [], self.logprobs, self.finish_reason, self.stop_string)

    def _shown(self, out: Output) -> tuple[str, list[TokenLogprob] | None]:
        """The text and log-probabilities of `out` that the choice shows."""
        return out.text, out.logprobs


class EchoChoice(TextChoice):
    """A choice after its prompt: the prompt's text, and its log-probabilities when the engine has sent them
    by then, lead the choice's first piece."""

    def __init__(self, prompt: EchoedPrompt) -> None:
        super().__init__()
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
    """A choice read for tool calls as it comes: its pieces carry content and call deltas; the whole
    choice's text is None when the reply is only calls."""

    def __init__(self, fmt: ToolFormat, one_call: bool = False) -> None:
        super().__init__()
        self._parser = ToolCallStreamParser(fmt)
        self._one_call = one_call  # calls after the first are dropped (parallel calls switched off)
        self._parsed: list[StreamDelta] = []  # what the parser made of the text so far

    def feed(self, out: Output) -> list[Piece]:
        self._note(out, out.logprobs)
        pieces = []
        if out.text or out.logprobs or out.reasoning:
            pieces.append(self._piece(self._parser.feed(out.text), out.reasoning, None, out.logprobs))
        if out.finish_reason:
            pieces.append(self._piece(self._parser.finish(), "", out.finish_reason, None))
        return pieces

    def finish(self) -> Whole:
        content, calls = assemble(self._parsed)
        return Whole(self.reasoning, content, calls, self.logprobs, _with_calls(self.finish_reason, bool(calls)),
                     self.stop_string)

    def _piece(self, parsed: StreamDelta, reasoning: str, finish_reason: str | None,
               entries: list[TokenLogprob] | None) -> Piece:
        if self._one_call:
            parsed = StreamDelta(parsed.content, [d for d in parsed.tool_calls if d.index == 0])
        self._parsed.append(parsed)
        return Piece(reasoning, parsed.content, parsed.tool_calls, entries,
                     _with_calls(finish_reason, bool(self._parser.calls)),
                     stop_string=self.stop_string if finish_reason else None)


def _with_calls(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason for a reply that ended by itself after making tool calls."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


class Reply:
    """Every choice of one HTTP request, each with its writer (made at its first output), and the usage.
    Outputs come by engine request: `first` is the index of its first choice (its own `index` counts
    from there). `echo`: each echoed prompt's text by its first choice; `calls_in`: the tool-call format
    to read (chat with tools); `one_call`: a choice's calls after its first are dropped."""

    def __init__(self, prompt_tokens: dict[int, int | None], echo: dict[int, str] | None = None,
                 calls_in: ToolFormat | None = None, one_call: bool = False) -> None:
        self.usage = Tally(prompt_tokens)
        self._prompts = {first: EchoedPrompt(text) for first, text in (echo or {}).items()}
        self._calls_in = calls_in
        self._one_call = one_call
        self._choices: dict[int, ChoiceWriter] = {}

    def feed(self, first: int, out: Output) -> tuple[int, list[Piece]]:
        """The choice `out` is for (an output of the engine request whose first choice is `first`) and the
        pieces it adds to it."""
        self.usage.add(first, out)
        index = first + out.index
        if index not in self._choices:
            self._choices[index] = self._writer(first)
        return index, self._choices[index].feed(out)

    def finish(self) -> list[tuple[int, Whole]]:
        """Every choice whole, in index order."""
        return [(i, self._choices[i].finish()) for i in sorted(self._choices)]

    def _writer(self, first: int) -> ChoiceWriter:
        if first in self._prompts:
            return EchoChoice(self._prompts[first])
        if self._calls_in is not None:
            return ToolCallChoice(self._calls_in, self._one_call)
        return TextChoice()
