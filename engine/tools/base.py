"""What every tool-call format shares: the calls and stream pieces the parsers give, and `ToolSyntax`, the
base each format's module (qwen.py, llama3.py) fills in with what is its own."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

from engine.structured import GrammarSpec

ToolFormat = Literal["qwen", "llama3"]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One complete call; `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: its first carries `id` and `name` (and arguments ""), later ones only
    `arguments`, the next fragment of the arguments' JSON text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The entry of a streamed chunk's `delta.tool_calls`."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamDelta:
    """What one piece of model text added: content to show and tool-call pieces (either may be empty)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class Split(NamedTuple):
    """Unread reply text, split where the next call starts: `content` to show now, `rest` still unread
    (when a call starts, its text), and `lead`, the text that opened the call (a tag, whitespace), given
    back as content if it turns out to be no call; None while no call starts."""

    content: str
    rest: str
    lead: str | None = None


class ToolSyntax(ABC):
    """One tool-call format: everything in which formats differ. The class says which chat templates teach
    it and how calls are forced; an instance reads one reply, deciding where calls start and what of the
    rest is content (the calls' JSON is read by the shared `StreamedCall`, which ends one at `close_tag`).
    A new format is a subclass in a module of its own, listed in formats.py."""

    argument_key: ClassVar[str]  # what the format names a call's arguments
    close_tag: ClassVar[str | None]  # the text that ends each call; None: a call ends with its JSON object

    @staticmethod
    @abstractmethod
    def taught_by(template: str) -> bool:
        """Whether a chat template's text teaches this format."""

    @staticmethod
    @abstractmethod
    def forced_grammar(schema: dict[str, Any], one: bool) -> GrammarSpec:
        """The grammar that makes a whole reply calls whose objects follow `schema` (`one`: exactly one)."""

    @abstractmethod
    def split(self, text: str, final: bool) -> Split:
        """Read `text` (no call in progress) up to the next call's start; `final`: no more text comes."""

    @abstractmethod
    def not_a_call(self, raw: str) -> str:
        """A call's text that did not parse as one: the content to show for it."""

    @abstractmethod
    def call_ended(self) -> None:
        """A call just ended (what follows it is read next)."""

    @abstractmethod
    def leftover(self, unread: str) -> str:
        """The reply ended with `unread` text that started no call: the content still to show."""
