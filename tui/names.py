"""How a request is shown across the ops panels: a short label and a stable colour.

The same request appears in the waiting queue, the running set, its request slot, its KV pages and
the step timeline; one colour per request lets the eye follow it from panel to panel, and a label
naming the chat session (for this app's own requests) tells a person which requests are theirs.
"""

from __future__ import annotations

import re

from rich.text import Text

# Control characters a model (or another client's request id) may produce would drive the terminal
# itself; show them as their Unicode "control pictures" instead (newlines and tabs stay as they are).
_VISIBLE = {c: 0x2400 + c for c in range(32) if chr(c) not in "\n\t"} | {127: 0x2421} | {
    c: 0xFFFD for c in range(0x80, 0xA0)}


def printable(text: str) -> str:
    """`text` with control characters made visible and harmless."""
    return text.translate(_VISIBLE)


COLOURS = ("#e06c75", "#98c379", "#e5c07b", "#61afef", "#c678dd", "#56b6c2", "#d19a66", "#be5046",
           "#7ec699", "#f78c6c", "#82aaff", "#c3e88d", "#ff9cac", "#89ddff", "#ffcb6b", "#a9b1d6")


REMEMBERED = 1024  # other clients' requests whose sender is remembered
NOISE = re.compile(r"(?:[a-z]+-)?[0-9a-f]{12,}")  # a generated id: a uuid's hex, perhaps after `http-`


class RequestNames:
    """Labels for this app's own requests (the session that sent them), the engine's labels for other
    clients' ("bench", "client 3"), and colours handed out in turn, so requests alive at the same time
    rarely share one. Another client's request shows its id, unless the id is a generated one (hex):
    then who sent it and the id's last characters, e.g. `bench 3f2a`."""

    def __init__(self) -> None:
        self._labels: dict[str, str] = {}
        self._colours: dict[str, str] = {}
        self._clients: dict[str, str] = {}  # live requests of other clients -> who sent them

    def colour(self, rid: str) -> str:
        if rid not in self._colours:
            self._colours[rid] = COLOURS[len(self._colours) % len(COLOURS)]
        return self._colours[rid]

    def own(self, rid: str, label: str) -> None:
        self._labels[rid] = label

    def is_own(self, rid: str) -> bool:
        return rid in self._labels

    def learn(self, clients: dict[str, str]) -> None:
        """Who sent each live request (the engine's labels, from a stats snapshot). The last REMEMBERED are
        kept after they end, for the step timeline's recent steps."""
        self._clients.update(clients)
        while len(self._clients) > REMEMBERED:
            del self._clients[next(iter(self._clients))]

    def owner(self, rid: str) -> str:
        """Who sent a request: a session of this console, or the engine's label for another client."""
        if rid in self._labels:
            return f"this console: {printable(self._labels[rid])}"
        return printable(self._clients.get(rid, "")) or "?"

    def label(self, rid: str, width: int = 14) -> str:
        text = self._labels.get(rid)
        if text is None:
            client = self._clients.get(rid, "")
            text = f"{client if len(client) <= 9 else client.split()[0]} {rid[-4:]}" \
                if client and NOISE.fullmatch(rid) else rid
        text = printable(text)
        return text if len(text) <= width else text[: width - 1] + "…"

    def styled(self, rid: str, width: int = 14) -> Text:
        style = self.colour(rid) + (" bold" if rid in self._labels else "")
        return Text(self.label(rid, width), style=style)
