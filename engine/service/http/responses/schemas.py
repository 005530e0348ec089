"""OpenAI's Responses API body (`POST /v1/responses`) and the chat it stands for: `instructions` as the
system turn, `input` as text or items (messages with text parts, `function_call` items as the assistant's
tool calls, `function_call_output` items as "tool" turns, `reasoning` items as the assistant's
`reasoning_content`), function tools, `text.format` (json_schema / json_object) through the grammar, and
`reasoning.effort` as the template's `enable_thinking`: "none" and "minimal" switch it off, any other
effort on (the engine has no finer grades of effort).

Nothing is stored: `store: true`, `previous_response_id`, `conversation`, `background` and `include` are
refused with a 400 naming the field (a response kept only in this process's memory would be lost at
every restart, and no client could tell), and so are other item and tool types, `truncation: "auto"`,
`max_tool_calls` and `top_logprobs`. Unknown fields are ignored, as the OpenAI routes do; `logit_bias` and
`ignore_eos` are taken as on chat and completions.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from engine.params import InvalidParams, SamplingParams
from engine.prompt import ChatMessage, Tools
from engine.service.http.schemas import (
    EngineRequest,
    KeepAlive,
    LogitBias,
    Wire,
    logit_bias,
    renamed,
    thinking,
    tool_setup,
    unsupported,
)
from engine.service.protocol import Info
from engine.structured import ANY_OBJECT_SCHEMA, GrammarSpec, InvalidGrammar
from engine.tools import ToolFormat

NO_THINKING = ("none", "minimal")  # the efforts that switch thinking off


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    """A turn; `type` may be left out (the API's "easy input message")."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    """Thinking an earlier reply returned; it goes with the assistant turn after it (the full thinking when
    the item has it, else its summary)."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: Annotated[str | None, unsupported(None)] = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content if self.content else self.summary))


def _item_kind(value: Any) -> str | None:
    """An item's kind: its `type`, "message" for a turn given without one."""
    if isinstance(value, dict):
        return value.get("type", "message") if ("type" in value or "role" in value) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="item_type", custom_error_message=(
        "must be a message, function_call, function_call_output or reasoning item"))]


class FunctionTool(_Item):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls forced by tool_choice follow the schema whatever it says

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(include={"name", "description", "parameters"},
                                                                exclude_none=True)}


class NamedFunction(_Item):
    type: Literal["function"]
    name: str


class Format(_Item):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Item):
    format: Format | None = None
    verbosity: Annotated[str | None, unsupported(None, "medium")] = None


class ReasoningConfig(_Item):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    keep_alive: KeepAlive = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1), Wire] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most, as on chat (`one_call`)
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None  # given back in the response
    logit_bias: LogitBias | None = None  # extensions, as on chat and completions
    ignore_eos: bool = False
    store: Annotated[bool | None, unsupported(False, None)] = None
    previous_response_id: Annotated[str | None, unsupported(None)] = None
    conversation: Annotated[Any, unsupported(None)] = None
    background: Annotated[bool | None, unsupported(False, None)] = None
    include: Annotated[list[str] | None, unsupported(None, [])] = None
    truncation: Annotated[str | None, unsupported(None, "disabled")] = None
    max_tool_calls: Annotated[int | None, unsupported(None)] = None
    top_logprobs: Annotated[int | None, unsupported(None, 0)] = None

    @model_validator(mode="after")
    def _calls_add_up(self) -> ResponsesRequest:
        """A function_call's arguments are JSON, and a function_call_output answers an earlier function_call."""
        called: set[str] = set()
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            if isinstance(item, FunctionCallItem):
                try:
                    json.loads(item.arguments)
                except ValueError:
                    raise ValueError(f"input[{i}].arguments: not JSON ({item.arguments[:40]!r})") from None
                called.add(item.call_id)
            elif isinstance(item, FunctionCallOutputItem) and item.call_id not in called:
                raise ValueError(f"input[{i}].call_id: no function_call with call_id {item.call_id!r} before it")
        return self

    def chat(self) -> list[ChatMessage]:
        """The conversation as the engine's chat template takes it."""
        out: list[ChatMessage] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        thinking_text = ""
        for item in self.input:
            if isinstance(item, ReasoningItem):
                thinking_text += item.text()
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
            elif isinstance(item, FunctionCallItem):
                turn = _assistant(out, thinking_text)
                turn.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                    "name": item.name, "arguments": item.arguments}})
                thinking_text = ""
            elif item.role == "assistant":
                turn = _assistant(out, thinking_text)
                turn["content"] += item.text()
                thinking_text = ""
            else:
                out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        return out

    def tools_for(self, fmt: ToolFormat | None) -> tuple[Tools | None, GrammarSpec | None]:
        """The tools for the template and the grammar forcing calls ("required", a named function), if any."""
        choice, tools = self.tool_choice, [t.to_openai() for t in self.tools or ()]
        if isinstance(choice, NamedFunction):
            return tool_setup(tools, fmt, "named", choice.name)
        return tool_setup(tools, fmt, choice or "auto", one=self.one_call)

    @property
    def one_call(self) -> bool:
        return self.parallel_tool_calls is False

    def structured(self) -> GrammarSpec | None:
        """`text.format` as a grammar (None for plain text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise InvalidParams("text.format: json_schema needs its 'schema'")
        value = json.dumps(fmt.schema_) if fmt.type == "json_schema" else ANY_OBJECT_SCHEMA
        try:
            return GrammarSpec(kind="json_schema", value=value)
        except InvalidGrammar as e:
            raise InvalidGrammar(f"text.format: {e}") from None

    def template_kwargs(self) -> dict[str, Any] | None:
        effort = self.reasoning.effort if self.reasoning is not None else None
        return None if effort is None else {"enable_thinking": effort not in NO_THINKING}

    def engine_requests(self, info: Info) -> list[EngineRequest]:
        tools, forced = self.tools_for(cast("ToolFormat | None", info.tool_format))
        structured = self.structured()
        if forced is not None and structured is not None:
            raise InvalidParams("tool_choice forces tool calls; it cannot go with text.format's structure")
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort in NO_THINKING:
            reasoning, budget = info.think_markers is not None, 0 if info.think_markers is not None else None
        else:
            reasoning, budget = thinking(info, None, "reasoning")
            if effort is not None and not reasoning:
                raise InvalidParams("reasoning: this model's chat template has no think block")
        with renamed({"max_tokens": "max_output_tokens"}):
            params = SamplingParams(max_tokens=self.max_output_tokens or info.max_seq_len,
                                    temperature=1.0 if self.temperature is None else self.temperature,
                                    top_p=1.0 if self.top_p is None else self.top_p, structured=structured or forced,
                                    reasoning=reasoning, thinking_token_budget=budget,
                                    logit_bias=logit_bias(self.logit_bias), ignore_eos=self.ignore_eos)
        return [EngineRequest(0, self.chat(), params, tools, self.template_kwargs(), self.one_call)]


def _assistant(turns: list[ChatMessage], reasoning: str) -> ChatMessage:
    """The assistant turn the next output item belongs to: the last turn if it is the assistant's and no
    reasoning starts a new one, else a new one (carrying `reasoning`)."""
    if turns and turns[-1]["role"] == "assistant" and not reasoning:
        return turns[-1]
    turn: ChatMessage = {"role": "assistant", "content": ""}
    if reasoning:
        turn["reasoning_content"] = reasoning
    turns.append(turn)
    return turn
