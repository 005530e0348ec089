"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, or, for Anthropic's
Messages API (`/v1/messages...`), in Anthropic's, `{"type": "error", "error": {"type", "message"}}` with
its type named by the status; and the one translation from pydantic's validation errors into them: `param`
names the field as the client wrote it (`messages[0].role`) and the message is a sentence about that
field ("temperature: must be >= 0, got -1", "'messages' must contain at least one message"), never
pydantic's "Input should be ..." or the names it gives a union's members.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse

RETRY_AFTER = "1"
"""Seconds a 503 (the engine's queue or a client's share of it full, the engine restarting) tells a client to wait:
queues move in steps of milliseconds, so a second is long enough and the SDKs' own backoff short enough."""


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's Messages API, and its count_tokens
# Anthropic's error type by status (its SDK raises by status; the type tells a reader what happened)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def speaks_anthropic(path: str) -> bool:
    """Whether a request path is Anthropic's API, whose errors have Anthropic's shape."""
    return path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class ApiError(Exception):
    """An error answered with `status` and an OpenAI-style body (Anthropic's on its API's paths)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @property
    def headers(self) -> dict[str, str]:
        """What the status asks for besides the body: the scheme to authenticate with, or when to come back."""
        return {"WWW-Authenticate": "Bearer"} if self.status == 401 else \
            {"Retry-After": RETRY_AFTER} if self.status == 503 else {}

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), self.status, headers=self.headers)

    def body(self, path: str = "") -> dict[str, Any]:
        """The error's body as the API at `path` shapes errors."""
        if speaks_anthropic(path):
            return anthropic_body(self.status, self.message)
        return error_body(self.message, self.type, self.param, self.code)


# pydantic's type errors -> what the field must be (a union's members' errors at one place are merged)
_KINDS = {"string_type": "a string", "int_type": "an integer", "int_parsing": "an integer",
          "int_from_float": "an integer", "float_type": "a number", "float_parsing": "a number",
          "bool_type": "a boolean", "bool_parsing": "a boolean",
          "list_type": "a list", "dict_type": "an object", "model_type": "an object",
          "model_attributes_type": "an object"}
_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}


def validation_error(errors: Sequence[Any], body: Any) -> ApiError:
    """The 400 for a body pydantic refused: its most telling error, as a sentence naming the field.

    A union reports one error per member, so the pick prefers a broken rule (a bound, a length, a
    missing field) over a type mismatch, then the deepest place; type mismatches at that place are
    merged into one "must be a string or a list"."""
    if not errors:
        return ApiError(400, "The request body is invalid.", code="invalid_value")
    placed = [(_path(e.get("loc", ()), body, e["type"]) + _tag_key(e), e) for e in errors]
    path, first = min(placed, key=lambda pe: (pe[1]["type"] in _KINDS, -len(pe[0])))
    kinds = [_KINDS[e["type"]] for p, e in placed if p == path and e["type"] in _KINDS]
    message = _message(first, path, list(dict.fromkeys(kinds)) if first["type"] in _KINDS else [])
    return ApiError(400, message, param=param_name(path), code="invalid_value")


def _message(error: dict[str, Any], path: list[str | int], kinds: list[str]) -> str:
    """The sentence for one pydantic error (`kinds`: what a type mismatch wanted instead)."""
    kind, ctx, param = error["type"], error.get("ctx") or {}, param_name(path)
    quoted = f"'{param}'" if param else "the request body"

    def must(clause: str) -> str:
        return f"{param or 'body'}: {clause}, got {_shown(error.get('input'))}"

    if kinds:
        return must("must be " + " or ".join(kinds))
    if kind == "missing":
        return f"Missing required parameter: {quoted}."
    if kind == "json_invalid":
        return f"We could not parse the JSON body of your request: {ctx.get('error', 'invalid JSON')}."
    if kind == "value_error":  # a validator's own sentence
        return f"{param}: {ctx['error']}" if param else str(ctx["error"])
    if kind in _BOUNDS:
        key, sign = _BOUNDS[kind]
        return must(f"must be {sign} {_shown(ctx[key])}")
    if kind == "union_tag_invalid":  # a tagged union's tag (a content block's "type") names no member
        return f"{param}: must be one of {ctx['expected_tags']}, got {_shown(ctx['tag'])}"
    if kind == "literal_error":
        expected = ctx["expected"]  # pydantic's: "'system', 'user' or 'assistant'"
        return must(f"must be {'one of ' if ' or ' in expected else ''}{expected}")
    if kind in _LENGTHS:
        return _length(kind, ctx, quoted, path)
    msg = str(error.get("msg", "is invalid"))  # our own errors (PydanticCustomError) and pydantic's rarer ones
    return must(msg[:1].lower() + msg[1:])


_LENGTHS = ("string_too_short", "string_too_long", "too_short", "too_long")


def _length(kind: str, ctx: dict[str, Any], quoted: str, path: list[str | int]) -> str:
    """The sentence for a string or list of the wrong length."""
    if kind == "string_too_short":
        least = ctx["min_length"]
        return f"{quoted} must not be empty" if least == 1 else f"{quoted} must be at least {least} characters long"
    if kind == "string_too_long":
        return f"{quoted} must be at most {_count(ctx['max_length'], 'character')} long"
    if kind == "too_short":
        least = ctx["min_length"]
        return f"{quoted} must contain at least {'one ' + _noun(path) if least == 1 else _count(least, _noun(path))}"
    return f"{quoted} must contain at most {_count(ctx['max_length'], _noun(path))}"


def _path(loc: Sequence[str | int], body: Any, kind: str) -> list[str | int]:
    """`loc` without what pydantic adds that the client never wrote: "body", and a union member's name
    (found by walking the body itself: a member's name is no key of it). A missing field is kept."""
    parts = loc[1:] if loc and loc[0] == "body" else loc
    path: list[str | int] = []
    node = body
    for i, part in enumerate(parts):
        written = ((isinstance(node, dict) and part in node)
                   or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)))
        if written:
            node = node[part]
        elif not (kind == "missing" and isinstance(node, dict) and i == len(parts) - 1):
            continue
        path.append(part)
    return path


def _tag_key(error: Any) -> list[str | int]:
    """For a tagged union's unknown tag, the tag's key (pydantic places the error at the object)."""
    if error["type"] != "union_tag_invalid":
        return []
    return [str((error.get("ctx") or {}).get("discriminator", "")).strip("'")]


def param_name(path: list[str | int]) -> str | None:
    """`messages[0].content` from ["messages", 0, "content"]."""
    text = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return text or None


def _noun(path: list[str | int]) -> str:
    """What a list holds, from its name: "messages" -> "message"; else "item"."""
    name = path[-1] if path and isinstance(path[-1], str) else ""
    return name[:-1] if name.endswith("s") and len(name) > 1 else "item"


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}{'s' if n != 1 else ''}"


def _shown(value: Any) -> str:
    """A value as the client wrote it (JSON), short; containers by kind."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    if isinstance(value, (bytes, bytearray)):  # a body that is not JSON at all: shown as the text it is
        return f"a body that is not JSON ({_shown(value.decode('utf-8', 'replace'))})"
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
