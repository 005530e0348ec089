"""A catalogue of models in the console (`minichat --models-dir DIR`, `--model NAME=PATH`): each model's engine is
started by its own `EngineLink` the first time a chat picks it, watched as one more replica of the fleet view, and
stopped when the console exits. No widgets here: the picker is tui/picker.py, the switching `MinichatApp`'s."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from engine.service.catalogue import Catalogue, Entry, engine_address
from tui.fleet import EngineReplica, Fleet
from tui.link import EngineLink
from tui.status import size


@dataclass(frozen=True)
class Row:
    """A model as the picker lists it."""

    id: str
    format: str
    size: str
    state: str  # "not started", or its engine link's state (ready, starting, failed, ...)


class ModelShelf:
    """The catalogue's models and the engines started for them so far (each a replica of `fleet`)."""

    def __init__(self, catalogue: Catalogue, engine_options: dict[str, Any], fleet: Fleet) -> None:
        self.catalogue, self.engine_options, self.fleet = catalogue, engine_options, fleet
        self.links: dict[str, EngineLink] = {}

    def link(self, model: str) -> tuple[EngineLink, bool]:
        """The link to `model`'s engine, and whether it was made just now (then the app runs it); ValueError naming
        the ids for a model the catalogue does not have."""
        entry = self.entry(model)
        if entry.id in self.links:
            return self.links[entry.id], False
        link = EngineLink(address=engine_address(f"console {os.getpid()}", entry.id), model=str(entry.path),
                          engine_options=self.engine_options)
        self.links[entry.id] = link
        self.fleet.replicas.append(EngineReplica(link))
        return link, True

    def entry(self, model: str) -> Entry:
        entry = self.catalogue.find(model)
        if entry is None:
            raise ValueError(f"no model {model!r} in the catalogue: {', '.join(self.catalogue.ids())}")
        return entry

    def model_of(self, link: EngineLink) -> str | None:
        """The catalogue id whose engine `link` reaches."""
        return next((m for m, lnk in self.links.items() if lnk is link), None)

    def rows(self) -> list[Row]:
        return [Row(e.id, e.format, size(e.disk_bytes), self.links[e.id].state.kind if e.id in self.links
                    else "not started") for e in self.catalogue]

    def stop_engines(self) -> list[int]:
        """Stop every engine the console started; their pids."""
        stopped = []
        for link in self.links.values():
            if link.handle is not None:
                stopped.append(link.handle.pid)
            link.stop_engine()
        return stopped
