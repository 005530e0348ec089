"""Session commands, one table for three doors: `/slash` commands typed in the prompt box, entries in
the command palette (ctrl+p), and the help screen. Adding a command here makes it appear in all three.

The table is data and imports no widgets: what each command does is `MinichatApp.command_handlers`,
one callable per name (most of them the chat pane's own methods), which a test holds to this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """`arg` names the argument, if the command takes one; the palette and the keys ask for it in a dialog
    unless `ask` is False: the command does something useful without it, as `/name` alone does."""

    name: str
    title: str
    help: str
    arg: str | None = None
    ask: bool = True

    @property
    def asks(self) -> bool:
        """Whether the palette and the keys ask for the argument before running the command."""
        return self.arg is not None and self.ask


COMMANDS = (
    Command("new", "New chat session", "open another session (optionally named)", "name", ask=False),
    Command("close", "Close chat session", "close this session's tab, stopping its reply (it stays saved)"),
    Command("tab", "Go to tab N", "bring the Nth tab to the front (ctrl+t then a digit does it for 1-9)", "N"),
    Command("tabs", "List open tabs", "the open tabs, numbered; a digit or enter goes to one (ctrl+t)"),
    Command("rename", "Rename chat session", "give this session a new name", "name"),
    Command("sessions", "List saved conversations", "search, reopen, rename, delete or export them (ctrl+o)",
            "search", ask=False),
    Command("export", "Export conversation as Markdown", "write this session to a Markdown file (default: "
            "exports/ in the data directory)", "path", ask=False),
    Command("regen", "Regenerate the last reply", "send the last message again in place of its reply (ctrl+r)"),
    Command("edit", "Edit and resend a message", "put message N (default: the last) back in the prompt box; "
            "enter sends it in place of the old one and forgets the turns after it (up in an empty box does it "
            "for the last)", "N", ask=False),
    Command("copy", "Copy a reply", "copy reply N (default: the last) to the clipboard, through the terminal "
            "(OSC 52: most terminals; in tmux, `set -g set-clipboard on`)", "N", ask=False),
    Command("clear", "Clear the context", "start afresh: the model sees none of the turns so far (they stay "
            "on screen and saved)"),
    Command("system", "Set system prompt", "the system message sent before the history (empty: none)", "text"),
    Command("temperature", "Set temperature", "sampling temperature; 0 is greedy", "value"),
    Command("top_p", "Set top-p", "nucleus sampling: keep the smallest set of tokens with this much mass", "value"),
    Command("top_k", "Set top-k", "sample among the k likeliest tokens; -1 turns it off", "value"),
    Command("min_p", "Set min-p", "drop tokens less likely than this share of the likeliest one's probability; 0 "
            "turns it off", "value"),
    Command("repetition_penalty", "Set repetition penalty", "make tokens already in the prompt or the reply less "
            "likely by this factor (transformers' rule; above 1 discourages repeats); 1 turns it off", "value"),
    Command("max_tokens", "Set max tokens", "the longest reply, in tokens (below the model's context)", "value"),
    Command("ignore_eos", "Set ignore EOS", "on: keep generating past the end-of-text token, up to max tokens "
            "(long replies, to watch batching)", "on|off"),
    Command("reset", "Reset the sampling settings", "back to the model's own defaults (its generation_config.json, "
            "shown as `model default`), the console's where it has none: forgets the settings chosen in this session"),
    Command("priority", "Set priority", "this session's requests' scheduling priority: lower runs first under the "
            "engine's --schedule-policy priority, and is retracted last (default 0)", "value"),
    Command("think", "Thinking on or off", "ask the chat template to let the model think (on) or not (off), "
            "sent as enable_thinking with this session's messages; a reasoning model's thinking shows folded under "
            "its reply, with its token count (f3 unfolds it)", "on|off"),
    Command("fanout", "Fan out a prompt", "open N sessions that all send the prompt at once, or one per "
            "variation when the prompts are separated by |; their tabs are a group of scratch tabs, not saved "
            "unless kept", "N prompt [| prompt …]"),
    Command("keep", "Keep this fan-out tab", "make this fan-out tab an ordinary conversation: saved, and "
            "reopened at the next start"),
    Command("closegroup", "Close fan-out group", "close every tab of this tab's fan-out at once, stopping their "
            "replies (ctrl+g)"),
    Command("abort", "Stop generation", "abort this session's reply; the text so far is kept"),
    Command("engine", "Pin this chat to a replica", "send this chat's next messages to replica N of the fleet "
            "(--engines; f4 lists them); without N, say which engine it talks to", "N"),
    Command("model", "Pick this chat's model", "with a catalogue (--models-dir): send this chat's next messages to "
            "that model, its engine started if need be; without a name, the picker (f9)", "name", ask=False),
    Command("compare", "Compare models on a prompt", "with a catalogue: one tab per model, all sending the prompt at "
            "once, side by side: `/compare smol,gemma Tell me a story`", "models prompt"),
    Command("reconnect", "Reconnect to the engine", "look for the engine again, starting one if allowed"),
    Command("help", "Help: keys and commands", "list every key binding and command"),
)
BY_NAME = {c.name: c for c in COMMANDS}
ALIASES = {"temp": "temperature", "top-p": "top_p", "top-k": "top_k", "min-p": "min_p", "max": "max_tokens",
           "rep": "repetition_penalty", "repetition": "repetition_penalty", "prio": "priority", "defaults": "reset",
           "fan": "fanout", "stop": "abort", "sys": "system", "list": "sessions", "open": "sessions",
           "regenerate": "regen", "retry": "regen", "closefan": "closegroup"}


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


def parse_compare(arg: str) -> tuple[list[str], str]:
    """`a,b,c prompt` -> (the models, each once, and the prompt)."""
    head, _, prompt = arg.strip().partition(" ")
    models = list(dict.fromkeys(m.strip() for m in head.split(",") if m.strip()))
    if len(models) < 2 or not prompt.strip():
        raise ValueError("/compare needs two models or more and a prompt: `/compare smol,gemma Tell me a story`")
    return models, prompt.strip()


def parse_number(arg: str, what: str) -> int | None:
    """`/tab 3`, `/edit 2`: the 1-based number given, None for none; ValueError for anything else."""
    if not arg:
        return None
    if not arg.isdigit() or int(arg) < 1:
        raise ValueError(f"{what} takes a number from 1; got {arg!r}")
    return int(arg)
