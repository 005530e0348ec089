"""`minichat models` and `minichat ps` as text: a catalogue's models (from a server's /v1/models, or read from
--models-dir / --model NAME=PATH here), and the loaded ones with their memory, requests and idle time."""

from __future__ import annotations

from typing import Any

from tui.status import size

COLUMNS = ("ID", "FORMAT", "SIZE", "LOADED", "MEMORY", "REQUESTS", "IDLE", "UNLOADS IN")


def render(cards: list[dict[str, Any]], loaded_only: bool = False) -> str:
    """One row a model: what it is, and for a loaded one what it holds (a single-model server's one model is
    loaded by definition; `loaded` None: not known, a catalogue read without a server)."""
    rows = [COLUMNS if not loaded_only else ("ID", "FORMAT", "MEMORY", "REQUESTS", "IDLE", "UNLOADS IN", "PID")]
    for card in cards:
        loaded = card.get("loaded", True)
        if loaded_only and not loaded:
            continue
        expires = card.get("expires_in")
        values = {
            "ID": card["id"], "FORMAT": card.get("format") or card.get("weights") or "-",
            "SIZE": size(card["size_bytes"]) if "size_bytes" in card else "-",
            "LOADED": "-" if loaded is None else "yes" if loaded else "failed" if card.get("load_error") else "no",
            "MEMORY": size(card["memory_bytes"]) if card.get("memory_bytes") else "-",
            "REQUESTS": str(card.get("requests_in_flight", "-")),
            "IDLE": f"{card['idle_seconds']:.0f}s" if "idle_seconds" in card else "-",
            "UNLOADS IN": "-" if not loaded or "keep_alive" not in card else
            ("never" if expires is None and card.get("keep_alive", 0) < 0 else
             "busy" if expires is None else f"{expires:.0f}s"),
            "PID": str(card.get("pid", "-")),
        }
        rows.append(tuple(values[c] for c in rows[0]))
    if len(rows) == 1:
        return "no model is loaded" if loaded_only else "no models"
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    errors = [f"{c['id']}: {c['load_error']}" for c in cards if c.get("load_error") and not loaded_only]
    return "\n".join(lines + errors)
