"""A checkpoint's own sampling recommendations: the settings its generation_config.json names, which vLLM
applies to every request by default and most instruct checkpoints ship (a small model sampled at some
other client's defaults wanders off topic where its own settings answer well).

The engine only reports them (its `info`, engine/service/protocol.py); the console starts its chats from
them. A GGUF file carries no generation_config.json: llama.cpp's `general.sampling.*` metadata, where a file
has it, is written into the checkpoint directory its metadata is converted into (engine/model/gguf.py) as
one, so both kinds of checkpoint are read here the same way; a file without those keys has no defaults.
Torch-free.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine.params import InvalidParams, SamplingParams

log = logging.getLogger(__name__)

FILE = "generation_config.json"
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation_config keys vLLM takes as a request's defaults, which SamplingParams names the same."""
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
"""llama.cpp's GGUF metadata for the same settings."""


def generation_defaults(meta: Path) -> dict[str, float | int]:
    """The sampling settings `meta`/generation_config.json recommends, among KEYS; a value SamplingParams
    refuses is left out (and logged), so the defaults can always be sent as they are. `top_k` 0 is
    transformers' "off", which SamplingParams spells -1. `do_sample` is not read: as vLLM does, the values
    given are the defaults whatever it says."""
    path = meta / FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s is not readable JSON (%s); no sampling defaults from it", path, e)
        return {}
    defaults: dict[str, float | int] = {}
    for key in KEYS:
        value: Any = config.get(key) if isinstance(config, dict) else None
        if value is None:
            continue
        if key == "top_k" and value == 0:
            value = -1
        try:
            SamplingParams(**{key: value})
        except (InvalidParams, TypeError) as e:
            log.warning("%s: %s is left out of the sampling defaults: %s", path, key, e)
            continue
        defaults[key] = value
    return defaults
