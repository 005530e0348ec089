"""Session commands, one table for three doors: `/slash` commands typed in the prompt box, entries in
the command palette (ctrl+p), and the help screen. Adding a command here makes it appear in all three.

Each command names the app method that carries it out, by name, so this table imports no widgets.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Command:
    """`arg` names the argument, if the command takes one; the palette asks for it in a dialog.
    `handler` is the MinichatApp method run as `handler(command, arg, pane)`."""

    name: str
    title: str
    help: str
    arg: str | None = None
    handler: str = field(kw_only=True)


COMMANDS = (
    Command("new", "New chat session", "open another session (optionally named)", "name", handler="do_new"),
    Command("close", "Close chat session", "close this session's tab, stopping its reply (it stays saved)",
            handler="do_close"),
    Command("rename", "Rename chat session", "give this session a new name", "name", handler="do_rename"),
    Command("sessions", "List saved conversations", "search, reopen, rename, delete or export them (ctrl+o)",
            "search", handler="do_sessions"),
    Command("export", "Export conversation as Markdown", "write this session to a Markdown file (default: "
            "exports/ in the data directory)", "path", handler="do_export"),
    Command("clear", "Clear the context", "start afresh: the model sees none of the turns so far (they stay "
            "on screen and saved)", handler="do_clear"),
    Command("system", "Set system prompt", "the system message sent before the history (empty: none)", "text",
            handler="do_system"),
    Command("temperature", "Set temperature", "sampling temperature; 0 is greedy", "value", handler="do_setting"),
    Command("top_p", "Set top-p", "nucleus sampling: keep the smallest set of tokens with this much mass", "value",
            handler="do_setting"),
    Command("top_k", "Set top-k", "sample among the k likeliest tokens; -1 turns it off", "value",
            handler="do_setting"),
    Command("max_tokens", "Set max tokens", "the longest reply, in tokens (below the model's context)", "value",
            handler="do_setting"),
    Command("ignore_eos", "Set ignore EOS", "on: keep generating past the end-of-text token, up to max tokens "
            "(long replies, to watch batching)", "on|off", handler="do_setting"),
    Command("priority", "Set priority", "this session's requests' scheduling priority: lower runs first under the "
            "engine's --schedule-policy priority, and is retracted last (default 0)", "value", handler="do_setting"),
    Command("fanout", "Fan out a prompt", "open N sessions that all send the prompt at once, or one per "
            "variation when the prompts are separated by |", "N prompt [| prompt …]", handler="do_fanout"),
    Command("abort", "Stop generation", "abort this session's reply; the text so far is kept", handler="do_abort"),
    Command("reconnect", "Reconnect to the engine", "look for the engine again, starting one if allowed",
            handler="do_reconnect"),
    Command("help", "Help: keys and commands", "list every key binding and command", handler="do_help"),
)
BY_NAME = {c.name: c for c in COMMANDS}
ALIASES = {"temp": "temperature", "top-p": "top_p", "top-k": "top_k", "max": "max_tokens", "prio": "priority",
           "fan": "fanout", "stop": "abort", "sys": "system", "list": "sessions", "open": "sessions"}


def parse_slash(text: str) -> tuple[Command, str]:
    """`/name argument…` -> (command, argument); ValueError naming the known commands otherwise."""
    name, _, arg = text.strip().removeprefix("/").partition(" ")
    name = ALIASES.get(name.lower(), name.lower())
    if name not in BY_NAME:
        raise ValueError(f"unknown command /{name}; try /help (known: {', '.join('/' + c.name for c in COMMANDS)})")
    return BY_NAME[name], arg.strip()


def parse_fanout(arg: str) -> list[str]:
    """`N prompt` -> N copies of the prompt; `N a | b | c` -> N prompts cycling through the variations;
    `a | b | c` -> one prompt per variation."""
    head, _, rest = arg.strip().partition(" ")
    count = int(head) if head.isdigit() else None
    body = rest if count is not None else arg
    variations = [v.strip() for v in body.split("|") if v.strip()]
    if not variations:
        raise ValueError("fan-out needs a prompt: `/fanout 4 Tell me a story` or `/fanout a | b | c`")
    count = count if count is not None else len(variations)
    if not 1 <= count <= 64:
        raise ValueError(f"fan-out opens 1 to 64 sessions; got {count}")
    return [variations[i % len(variations)] for i in range(count)]
