"""Request bodies of the OpenAI-compatible API (pydantic, validated by FastAPI), and the one place a
generation body becomes engine requests (`GenerationRequest.engine_requests`).

Field names and shapes follow the OpenAI reference; `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, `priority`, the `guided_*` and `structured_outputs`
fields and `stream_options.continuous_usage_stats` are accepted as vLLM accepts them, and so are vLLM's
`/tokenize` and `/detokenize` bodies. Unknown fields are ignored, as OpenAI-compatible servers do, but
fields whose meaning we cannot honour (`best_of` other than n, `suffix`, tools for a model whose
template has none) are refused with a 400 rather than silently dropped. Every rule is declared on its field (a bound, a
length, `unsupported`), so errors.py words every refusal the same way. Integers the engine receives are
bounded to what its messages carry (`Wire`: MessagePack's 64 bits), and token ids must be JSON integers
(`[5, true]` is no prompt), so whatever passes here can be sent.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.params import MAX_LOGPROBS, MAX_N, InvalidParams, SamplingParams
from engine.prompt import ChatMessage, Prompt, Tools, check_template_kwargs
from engine.service.protocol import Info
from engine.structured import GrammarSpec, InvalidGrammar
from engine.tools import InvalidTools, ToolFormat, forced_tool_grammar, tool_functions

T = TypeVar("T")
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions (chat: whatever fits)
WIRE_RANGE = (-(2**63), 2**64)  # the integers an engine message (MessagePack) carries


def _on_the_wire(value: int) -> int:
    if not WIRE_RANGE[0] <= value < WIRE_RANGE[1]:
        raise PydanticCustomError("wire_range", "must be in [-2**63, 2**64), the integers an engine message carries")
    return value


Wire = AfterValidator(_on_the_wire)


def _below_2_64(digits: str) -> bool:
    """Whether a decimal without leading zeros is below 2**64 (checked by length first: int() refuses
    strings of thousands of digits)."""
    return len(digits) <= 20 and int(digits or "0") < WIRE_RANGE[1]


TokenId = Annotated[int, Field(ge=0, strict=True), Wire]  # strict: a JSON integer, not true or 5.0


def unsupported(*accepted: object) -> AfterValidator:
    """For a field this server cannot honour: only the values that ask for nothing (`accepted`) pass."""
    shown = " or ".join(json.dumps(a) for a in accepted)

    def check(value: T) -> T:
        if value not in accepted:
            raise PydanticCustomError("unsupported", "this server supports only {accepted}", {"accepted": shown})
        return value

    return AfterValidator(check)


def _token_id_keys(v: dict[str, float]) -> dict[str, float]:
    if not all(k.isascii() and k.isdigit() and _below_2_64(k.lstrip("0")) for k in v):
        raise ValueError("keys must be token ids (strings of digits, below 2**64)")
    return {k.lstrip("0") or "0": b for k, b in v.items()}  # int() of each is cheap


LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], AfterValidator(_token_id_keys)]


_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _seconds(value: object) -> float:
    """Ollama's `keep_alive`: seconds as a number, or a duration such as "30s", "5m", "1h" ("-1": for ever)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise PydanticCustomError("duration", "must be seconds or a duration such as \"5m\"")
    if isinstance(value, str):
        match = _DURATION.fullmatch(value.strip())
        if match is None:
            raise PydanticCustomError("duration", "must be seconds or a duration such as \"5m\"")
        value = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if value != value or abs(value) == float("inf"):
        raise PydanticCustomError("duration", "must be a finite number of seconds")
    return float(value)


KeepAlive = Annotated[float | None, BeforeValidator(lambda v: None if v is None else _seconds(v))]
"""How long a model of a multi-model server stays loaded after this request (Ollama's field)."""


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """A checked `logit_bias` as the engine takes it."""
    return {int(k): v for k, v in bias.items()} if bias else None


@dataclass(frozen=True)
class EngineRequest:
    """One engine request of an HTTP request: a prompt, its sampling, and the choice it fills; a chat's
    `tools` and `template_kwargs` for its template."""

    index: int
    prompt: Prompt
    params: SamplingParams
    tools: Tools | None = None
    template_kwargs: dict[str, Any] | None = None
    one_call: bool = False  # parallel tool calls switched off: the reply's first call is its only one


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with the whole request's usage
    continuous_usage_stats: bool = False  # vLLM's extension: every chunk carries the usage so far


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class GenerationRequest(BaseModel):
    """Fields both generation endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    keep_alive: KeepAlive = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1), Wire] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    priority: int = 0  # vLLM's extension: lower runs first under --schedule-policy priority
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] = 1.0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    logit_bias: LogitBias | None = None
    min_tokens: Annotated[int, Field(ge=0), Wire] = 0
    stop_token_ids: list[TokenId] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):  # OpenAI and vLLM refuse it too
            raise ValueError("stream_options is only allowed when 'stream' is true")
        return v

    def structured(self) -> GrammarSpec | None:
        """The one structure the output must follow, from whichever field asked for it (a 400 for two)."""
        fmt, so = self.response_format, self.structured_outputs
        asked: list[tuple[str, GrammarSpec]] = []
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", _grammar("response_format", "json_object", "")))
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format: json_schema needs its 'json_schema' object with a 'schema'")
            schema = json.dumps(fmt.json_schema.schema_)
            asked.append(("response_format", _grammar("response_format", "json_schema", schema)))
        for name, kind, value in (("guided_json", "json_schema", self.guided_json),
                                  ("guided_regex", "regex", self.guided_regex),
                                  ("guided_choice", "choice", self.guided_choice),
                                  ("guided_grammar", "grammar", self.guided_grammar),
                                  ("structured_outputs", "json_schema", so and so.json_),
                                  ("structured_outputs", "regex", so and so.regex),
                                  ("structured_outputs", "choice", so and so.choice),
                                  ("structured_outputs", "grammar", so and so.grammar)):
            if value is not None:
                text = value if isinstance(value, (str, list)) else json.dumps(value)
                asked.append((name, _grammar(name, kind, text)))
        if len(asked) > 1:
            raise ValueError(f"ask for one output structure, not {len(asked)} ({', '.join(n for n, _ in asked)})")
        return asked[0][1] if asked else None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(top alternatives per sampled token, per prompt token), None where not asked for."""
        return None, None

    def tools_for(self, tool_format: ToolFormat | None) -> tuple[Tools | None, GrammarSpec | None]:
        """The tools for the chat template and the grammar forcing calls (tool_choice), if any."""
        return None, None

    @property
    def one_call(self) -> bool:
        """Parallel tool calls are switched off: a reply makes one call at most (forced to one where calls
        are forced; any after the first dropped otherwise, as vLLM does)."""
        return False

    def template_kwargs(self) -> dict[str, Any] | None:
        """More variables for the chat template (chat only)."""
        return None

    def reasoning(self, info: Info) -> tuple[bool, int | None]:
        """Whether the replies' thinking is split off, and its budget (chat only, on a model that thinks)."""
        return False, None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops and any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops or None

    def budget(self, context: int) -> int:
        """The output budget asked for, or the endpoint's default (`context`: the model's)."""
        raise NotImplementedError

    def prompts(self) -> list[Prompt]:
        """The body's prompts, one per choice."""
        raise NotImplementedError

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def usage_at_the_end(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def params(self, context: int, forced: GrammarSpec | None = None, reasoning: tuple[bool, int | None] = (False, None)
               ) -> SamplingParams:
        """The engine's sampling parameters (temperature defaults to 1.0, as in the OpenAI API);
        InvalidParams for values the engine cannot use. `forced`: the grammar of forced tool calls;
        `reasoning`: whether the thinking is split off, and its budget."""
        assert not isinstance(self.stop, str)  # `_stop_strings` has made it a list
        logprobs, prompt_logprobs = self.logprob_counts()
        try:
            structured = self.structured()
        except InvalidGrammar:
            raise
        except ValueError as e:
            raise InvalidParams(str(e)) from e
        if forced is not None and structured is not None:
            raise InvalidParams("tool_choice forces tool calls; it cannot go with another output structure")
        structured = structured or forced
        return SamplingParams(max_tokens=self.budget(context),
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_k=-1 if self.top_k is None or self.top_k == 0 else self.top_k,
                              top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty,
                              logit_bias=logit_bias(self.logit_bias),
                              min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids, n=self.n,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured,
                              ignore_eos=self.ignore_eos, stop=self.stop, seed=self.seed, priority=self.priority,
                              reasoning=reasoning[0], thinking_token_budget=reasoning[1])

    def engine_requests(self, info: Info) -> list[EngineRequest]:
        """The engine requests this body stands for, one per prompt (they run concurrently, and batch);
        prompt i's n choices are choices i*n .. i*n + n - 1."""
        tools, forced = self.tools_for(cast("ToolFormat | None", info.tool_format))
        params = self.params(info.max_seq_len, forced, self.reasoning(info))
        kwargs = self.template_kwargs()
        return [EngineRequest(i * self.n, prompt, params, tools, kwargs, self.one_call)
                for i, prompt in enumerate(self.prompts())]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """One chat turn; `content` may be a string or a list of text parts (other parts are refused). An
    assistant turn that called tools has `tool_calls` (and may have no content); a "tool" turn answers
    the call `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant turn's thinking (vLLM's), for templates that render it

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


def _chat(messages: list[Message]) -> list[ChatMessage]:
    """Messages as the engine's chat template takes them ("developer" is OpenAI's new "system")."""
    out: list[ChatMessage] = []
    for m in messages:
        turn: ChatMessage = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            turn["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            turn["name"] = m.name
        if m.reasoning_content is not None:
            turn["reasoning_content"] = m.reasoning_content
        out.append(turn)
    return out


class FunctionTool(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionTool


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1), Wire] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), Wire] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most (`one_call`)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template (enable_thinking)
    thinking_token_budget: Annotated[int, Field(ge=0), Wire] | None = None  # vLLM's: the think block's budget

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            check_template_kwargs(v)
        except ValueError as e:  # its sentence names the field, as errors.py will
            raise ValueError(str(e).removeprefix("chat_template_kwargs ")) from None
        return v

    def template_kwargs(self) -> dict[str, Any] | None:
        return self.chat_template_kwargs

    def reasoning(self, info: Info) -> tuple[bool, int | None]:
        return thinking(info, self.thinking_token_budget, "thinking_token_budget")

    def tools_for(self, tool_format: ToolFormat | None) -> tuple[Tools | None, GrammarSpec | None]:
        choice = self.tool_choice
        tools = [t.model_dump(exclude_none=True) for t in self.tools or ()]
        if isinstance(choice, NamedToolChoice):
            return tool_setup(tools, tool_format, "named", choice.function.name)
        return tool_setup(tools, tool_format, choice or "auto", one=self.one_call)

    @property
    def one_call(self) -> bool:
        return self.parallel_tool_calls is False

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs 'logprobs': true")
        return self

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def budget(self, context: int) -> int:
        return self.max_completion_tokens or self.max_tokens or context

    def prompts(self) -> list[Prompt]:
        return [_chat(self.messages)]


def tool_setup(tools: Tools, fmt: ToolFormat | None, choice: str, name: str | None = None, one: bool = False
               ) -> tuple[Tools | None, GrammarSpec | None]:
    """A request's OpenAI function `tools` for the template (none when `choice` is "none") and, for
    "required" or "named" (the function `name`), the grammar that makes the reply those calls (`one`: a
    single call, where the client switched parallel calls off); InvalidParams naming what is wrong. Every
    API's tool choice comes down to one of these."""
    if not tools or choice == "none":
        return None, None
    if fmt is None:
        raise InvalidParams("tools: this model's chat template has no tool calling")
    try:
        names = tool_functions(tools)
        if choice == "named":
            if name not in names:
                raise InvalidTools(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
            return tools, forced_tool_grammar(fmt, tools, name)
        return tools, forced_tool_grammar(fmt, tools, one=one) if choice == "required" else None
    except InvalidTools as e:
        raise InvalidParams(str(e)) from e


def thinking(info: Info, budget: int | None, field: str) -> tuple[bool, int | None]:
    """A chat's reasoning on this model (split off wherever the model thinks) and the budget asked for in
    `field`; InvalidParams naming it for a model without a think block."""
    if budget is not None and info.think_markers is None:
        raise InvalidParams(f"{field}: this model's chat template has no think block")
    return info.think_markers is not None, budget


@contextlib.contextmanager
def renamed(fields: dict[str, str]) -> Iterator[None]:
    """InvalidParams raised inside, with the engine's name of a field (its sentence starts with it) replaced
    by the body's (Anthropic's `stop_sequences` is the engine's `stop`)."""
    try:
        yield
    except InvalidParams as e:
        text = str(e)
        for engine_name, body_name in fields.items():
            if re.match(rf"{engine_name}\b", text):
                raise InvalidParams(body_name + text[len(engine_name):]) from None
        raise


def _grammar(field: str, kind: str, value: str | list[str]) -> GrammarSpec:
    """The GrammarSpec a field asks for; InvalidGrammar naming the field when its shape or size is refused."""
    try:
        return GrammarSpec(kind=kind, value=value)  # type: ignore[arg-type]
    except InvalidGrammar as e:
        raise InvalidGrammar(f"{field}: {e}") from None


def _prompt_shape(value: Any) -> str | None:
    """Which of the four prompt forms a value is, from its first item (the form then checks every item)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return {str: "texts", int: "tokens", list: "token lists"}.get(type(value[0]) if value else int)
    return None


NonEmpty = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
CompletionPrompt = Annotated[
    Annotated[NonEmpty, Tag("text")]
    | Annotated[list[NonEmpty], Field(min_length=1), Tag("texts")]
    | Annotated[TokenIds, Tag("tokens")]
    | Annotated[list[TokenIds], Field(min_length=1), Tag("token lists")],
    Discriminator(_prompt_shape, custom_error_type="prompt_form", custom_error_message=(
        "must be a string, a list of strings, a list of token ids or a list of token-id lists"))]


class CompletionRequest(GenerationRequest):
    prompt: CompletionPrompt
    max_tokens: Annotated[int, Field(ge=0), Wire] | None = None  # 0 with echo: score the prompt (lm-eval)
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: int | None = None
    suffix: Annotated[str | None, unsupported(None)] = None

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported: every sample is returned")
        return self

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def budget(self, context: int) -> int:
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens

    def prompts(self) -> list[Prompt]:
        """One prompt per choice: text or token ids (a list of ints is one prompt; lists are homogeneous)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        ids = [t for t in self.prompt if isinstance(t, int)]
        return [ids] if ids else [p for p in self.prompt if not isinstance(p, int)]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a text `prompt`, or chat `messages` rendered with the model's template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    keep_alive: KeepAlive = None
    prompt: NonEmpty | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'messages' (chat)")
        return self

    def target(self) -> str | list[ChatMessage]:
        return self.prompt if self.prompt is not None else _chat(self.messages or [])


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    keep_alive: KeepAlive = None
    tokens: TokenIds
