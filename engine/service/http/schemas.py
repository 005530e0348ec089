"""Request and response bodies of the OpenAI-compatible API (pydantic, validated by FastAPI).

Field names and shapes follow the OpenAI reference; `top_k`, `ignore_eos` and `priority` are accepted
as vLLM accepts them. Unknown fields are ignored, as OpenAI-compatible servers do, but fields whose meaning
we cannot honour (`n` > 1, `logprobs`, `echo`, `best_of` > 1, tools) are refused with a 400 rather
than silently dropped. Everything here turns into one `engine.SamplingParams` for the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    priority: int = 0  # vLLM's extension: lower runs first under --schedule-policy priority
    n: Annotated[int, Field(ge=1, le=1)] = 1

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops and any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops or None

    def budget(self) -> int | None:  # the endpoints name the output budget differently
        raise NotImplementedError

    def params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters (temperature defaults to 1.0, as in the OpenAI API);
        InvalidParams for values the engine cannot use."""
        assert not isinstance(self.stop, str)  # `_stop_strings` has made it a list
        return SamplingParams(max_tokens=self.budget() or default_max_tokens,
                      temperature=1.0 if self.temperature is None else self.temperature,
                      top_k=-1 if self.top_k is None or self.top_k == 0 else self.top_k,
                      top_p=1.0 if self.top_p is None else self.top_p,
                      ignore_eos=self.ignore_eos, stop=self.stop, seed=self.seed, priority=self.priority)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat turn; `content` may be a string or a list of text parts (other parts are refused)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        """The messages as the engine's chat template takes them ("developer" is OpenAI's new "system")."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    echo: Literal[False] = False
    logprobs: None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: None = None

    @model_validator(mode="after")
    def _non_empty(self) -> CompletionRequest:
        if isinstance(self.prompt, str) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def budget(self) -> int | None:
        return self.max_tokens


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
