"""Anthropic's Messages API bodies (`POST /v1/messages`, `/v1/messages/count_tokens`) and the chat they
stand for: the system prompt, the turns with their content blocks (text; `tool_use` as the assistant's
tool calls and `tool_result` as "tool" turns, as engine/tools reads them; `thinking` as the assistant's
`reasoning_content`, which templates such as Qwen3's render), the tools as OpenAI function tools, and
`thinking` as the template's `enable_thinking` and the think block's budget.

What this server cannot honour is refused with a 400 naming the field, as on the OpenAI routes: content
blocks other than those four (images, documents), server tools, a last assistant turn to continue (a
prefill), `output_config.effort`, `thinking.display: "omitted"`. `disable_parallel_tool_use` makes a
reply one tool call at most (as `parallel_tool_calls: false` on the OpenAI routes). Unknown fields are
ignored, as the OpenAI routes do. `cache_control` marks are accepted: the engine's prefix cache reuses every
prompt's prefix whatever is marked.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.params import InvalidParams, SamplingParams
from engine.prompt import ChatMessage, Tools
from engine.service.http.schemas import EngineRequest, KeepAlive, Wire, renamed, thinking, tool_setup, unsupported
from engine.service.protocol import Info
from engine.structured import GrammarSpec, InvalidGrammar
from engine.tools import ToolFormat


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")

    cache_control: dict[str, Any] | None = None  # accepted: every prefix is cached anyway


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: Annotated[list[Any] | None, unsupported(None)] = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    """A tool's answer; `is_error` results are shown to the model prefixed with "Error: " (a chat template
    has no other way to say so)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or ())
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # this server signs nothing: what it returns has an empty one


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class MessageIn(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class ToolIn(BaseModel):
    """A client tool (server tools, typed "web_search_..." and the like, are refused by `type`)."""

    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a 'tool' choice names its tool ('name'); the other choices name none")
        return self


class ThinkingConfig(BaseModel):
    """`enabled` (with a budget), `disabled`, or `adaptive` (the model's own default)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0), Wire] | None = None
    display: Literal["summarized"] | None = None  # "omitted" would need a signature to carry the thinking

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("budget_tokens goes with type 'enabled', and only with it")
        return self


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: OutputFormat | None = None
    effort: Annotated[str | None, unsupported(None)] = None


class MessagesInput(BaseModel):
    """What a request renders into a prompt: count_tokens' whole body, and the first part of a create's."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    keep_alive: KeepAlive = None
    messages: Annotated[list[MessageIn], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="after")
    def _honourable(self) -> MessagesInput:
        _check_tool_results(self.messages)
        if self.messages[-1].role == "assistant":
            raise ValueError(f"messages[{len(self.messages) - 1}]: a last assistant turn to continue (a prefill) "
                             f"is not supported; end with a user turn")
        if self.thinking is not None and self.thinking.type == "enabled" and self.tool_choice is not None and \
                self.tool_choice.type in ("any", "tool"):  # as Anthropic's API refuses it
            raise ValueError("tool_choice: a forced tool call cannot go with thinking enabled (the thinking would "
                             "come first); use 'auto', or disable thinking")
        return self

    def chat(self) -> list[ChatMessage]:
        """The conversation as the engine's chat template takes it."""
        out: list[ChatMessage] = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": text})
        for m in self.messages:
            out += _turns(m)
        return out

    def tools_for(self, fmt: ToolFormat | None) -> tuple[Tools | None, GrammarSpec | None]:
        """The tools for the template and the grammar forcing calls (`any`, a named tool), if any."""
        choice = self.tool_choice
        kind = "auto" if choice is None else {"any": "required", "tool": "named"}.get(choice.type, choice.type)
        return tool_setup([t.to_openai() for t in self.tools or ()], fmt, kind, choice.name if choice else None,
                          one=self.one_call)

    @property
    def one_call(self) -> bool:
        return self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use

    def template_kwargs(self) -> dict[str, Any] | None:
        """`thinking` for templates that switch it (Qwen3's `enable_thinking`); adaptive leaves the default."""
        if self.thinking is None or self.thinking.type == "adaptive":
            return None
        return {"enable_thinking": self.thinking.type == "enabled"}

    def engine_requests(self, info: Info) -> list[EngineRequest]:
        """The one engine request (count_tokens renders its prompt only)."""
        tools, forced = self.tools_for(cast("ToolFormat | None", info.tool_format))
        return [EngineRequest(0, self.chat(), self.params(info, forced), tools, self.template_kwargs(),
                              self.one_call)]

    def params(self, info: Info, forced: GrammarSpec | None) -> SamplingParams:
        """The sampling (count_tokens samples nothing: the defaults, after the thinking is checked)."""
        self.reasoning(info)
        return SamplingParams()

    def reasoning(self, info: Info) -> tuple[bool, int | None]:
        """The thinking split off (on a model that thinks) and its budget: `enabled`'s, or 0 when
        `disabled` (a block the model opens anyway is closed at once)."""
        t = self.thinking
        if t is None or t.type == "adaptive":
            return thinking(info, None, "thinking")
        if t.type == "disabled":
            return info.think_markers is not None, 0 if info.think_markers is not None else None
        return thinking(info, t.budget_tokens, "thinking")


def _check_tool_results(messages: list[MessageIn]) -> None:
    """Every tool_result answers a tool_use of an earlier assistant turn (a result of no call is a client's bug)."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        for j, b in enumerate(m.blocks()):
            if isinstance(b, ToolUseBlock):
                called.add(b.id)
            elif isinstance(b, ToolResultBlock) and b.tool_use_id not in called:
                raise ValueError(f"messages[{i}].content[{j}].tool_use_id: no tool_use with id {b.tool_use_id!r} "
                                 f"before it")


def _turns(m: MessageIn) -> list[ChatMessage]:
    """One Anthropic turn as chat turns: a user turn's tool results become "tool" turns ahead of its text;
    an assistant turn's tool uses its tool calls, its thinking its reasoning_content."""
    blocks = m.blocks()
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if m.role == "user":
        turns: list[ChatMessage] = [{"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id}
                                    for b in blocks if isinstance(b, ToolResultBlock)]
        if text or not turns:
            turns.append({"role": "user", "content": text})
        return turns
    turn: ChatMessage = {"role": "assistant", "content": text}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        turn["tool_calls"] = calls
    reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    if reasoning:
        turn["reasoning_content"] = reasoning
    return [turn]


class MessagesRequest(MessagesInput):
    """`POST /v1/messages`."""

    max_tokens: Annotated[int, Field(ge=1, strict=True), Wire]  # strict: a JSON integer, not "10"
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0), Wire] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None  # accepted: nothing here reads it
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted: there is one tier
    container: Annotated[Any, unsupported(None)] = None
    mcp_servers: Annotated[Any, unsupported(None)] = None
    context_management: Annotated[Any, unsupported(None)] = None
    ignore_eos: bool = False  # an extension, as on the OpenAI routes (`minichat bench` sends it)

    def params(self, info: Info, forced: GrammarSpec | None) -> SamplingParams:
        structured = None
        if self.output_config is not None and self.output_config.format is not None:
            if forced is not None:
                raise InvalidParams("output_config.format: a forced tool call (tool_choice) cannot also follow "
                                    "an output format")
            try:
                structured = GrammarSpec(kind="json_schema", value=json.dumps(self.output_config.format.schema_))
            except InvalidGrammar as e:
                raise InvalidGrammar(f"output_config.format: {e}") from None
        reasoning, budget = self.reasoning(info)
        with renamed({"stop": "stop_sequences"}):
            return SamplingParams(max_tokens=self.max_tokens, top_p=1.0 if self.top_p is None else self.top_p,
                                  temperature=1.0 if self.temperature is None else self.temperature,
                                  top_k=-1 if not self.top_k else self.top_k, stop=self.stop_sequences or None,
                                  structured=structured or forced, reasoning=reasoning, thinking_token_budget=budget,
                                  ignore_eos=self.ignore_eos)
