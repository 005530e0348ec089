"""Structured outputs: token masks that keep a request's output inside a grammar (JSON schema, regex,
choice, EBNF grammar or xgrammar structural tag), computed by xgrammar.

xgrammar is optional: it is imported inside the functions that need it, so the engine runs without it
and a request that asks for a grammar is refused with "structured output needs xgrammar". This module
imports neither torch nor xgrammar at import time, because `GrammarSpec` travels on the wire (inside
SamplingParams) and the clients load no torch.

How the pieces fit (one engine, many requests):

    spec = GrammarSpec(kind="json_schema", value='{"type": "object", ...}')   # validated on construction
    compiler = GrammarCompiler(tokenizer, vocab_size=model_vocab, stop_token_ids=eos_ids)  # once per engine
    compiled = compiler.compile(spec)          # InvalidGrammar -> HTTP 400; cached, may run on a worker thread
    matcher = compiler.matcher(compiled)       # one per request, holds its parse state
    bitmask = compiler.allocate_bitmask(rows)  # once, reused every step (int32 [rows, ceil(vocab / 32)], CPU)
    # each step, before sampling:
    rows = fill_bitmask(bitmask, [matcher or None for each logits row])
    apply_bitmask(logits, bitmask, rows)       # float32 [N, vocab], in place; disallowed tokens -> -inf
    # after sampling, for each constrained row:
    matcher.accept(token_id)                   # False: the token is outside the grammar (state unchanged)
    matcher.is_terminated                      # the grammar is complete and a stop token was taken: "stop"
    matcher.rollback(k)                        # undo the last k accepted tokens (retraction, speculation)

Once the grammar is complete only the stop tokens (the engine's EOS ids) are allowed, so the request
ends with its EOS as usual; after that (a request that ignores EOS, say) the row allows only EOS too.

For the wiring: the mask goes on the raw logits, before temperature, top-k/top-p and the greedy
argmax, so every filter chooses among allowed tokens only. A row's mask depends on every token before
it, so each sampled token must be accepted before that request's next mask is filled (with overlapped
steps, a constrained request cannot have its next step scheduled before its last token is known).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    import torch
    import xgrammar
    from transformers import PreTrainedTokenizerBase

    from engine.reasoning import ThinkBlock

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[GrammarKind, ...] = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")

# A grammar is compiled in the engine process (off its loop, within the server's time limit); these bound what
# one request can make it compile. Compile time grows with nesting, rules and the vocabulary, not with characters:
# measured here (xgrammar 0.2.9), a schema nested 64 objects deep takes 0.06 s over the demo model's 4k tokens and
# 0.10 s over SmolLM2's 49k, 200 deep 1.6 s over 4k; 1,000 chained rules with character classes 0.18 s over 4k and
# 0.9 s over 49k.
MAX_SPEC_CHARS = 1 << 18
MAX_JSON_DEPTH = 128  # nesting of a json_schema / structural_tag document: 64 object levels, far past real schemas
MAX_GRAMMAR_RULES = 1024  # `name ::=` definitions in an EBNF grammar
_RULE = re.compile(r"^[ \t]*[A-Za-z_][\w.-]*[ \t]*::=", re.MULTILINE)
# Whitespace allowed between JSON tokens: a newline and 2-space indentation to depth 7, few enough that
# a small model given to whitespace (the random test models are) reaches the next token instead of its
# max_tokens after a few such runs.
MAX_JSON_WHITESPACE = 16
# Any JSON object: the `json_object` kind (OpenAI's response_format {"type": "json_object"}).
ANY_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's errors start with "[time] /path/file.cc:line: " and sometimes a failed check's text.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed:.*? is false:\s*)?")


class InvalidGrammar(ValueError):
    """A grammar that cannot be compiled (bad JSON schema, bad regex, ...); the message says what is wrong,
    so the API can answer 400 before the request is queued.

    Not an InvalidParams: engine/params.py will import this module for GrammarSpec, so this module
    cannot import it back; `invalid_params` has to recognise both."""


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a request's output must match. `value` by kind:

    - json_object: ignored (any JSON object);
    - json_schema: the schema as a JSON string;
    - regex: a regular expression the whole output must match;
    - choice: a list of strings, the output is exactly one of them;
    - grammar: an EBNF grammar (xgrammar's dialect, GBNF-like) whose start rule is `root`;
    - structural_tag: an xgrammar structural tag as a JSON string ({"type": "structural_tag", "format": ...}).

    Torch- and xgrammar-free, so it can ride in SamplingParams on the wire; the shape is checked on
    construction and on decoding, compiling finds the rest (`GrammarCompiler.compile`)."""

    kind: GrammarKind
    value: str | list[str] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidGrammar(f"grammar kind must be one of {', '.join(KINDS)}; got {self.kind!r}"[:300])
        if self.kind == "choice":
            if not isinstance(self.value, list) or not self.value or \
                    any(not isinstance(c, str) or not c for c in self.value):
                raise InvalidGrammar("choice must be a non-empty list of non-empty strings")
            size = sum(map(len, self.value))
        else:
            if not isinstance(self.value, str) or (not self.value and self.kind != "json_object"):
                raise InvalidGrammar(f"a {self.kind} grammar's value must be a non-empty string")
            size = len(self.value)
        if size > MAX_SPEC_CHARS:
            raise InvalidGrammar(f"a grammar may have at most {MAX_SPEC_CHARS} characters; this {self.kind} has {size}")
        if self.kind in ("json_schema", "structural_tag"):
            _json_document(self.kind, str(self.value))
        if self.kind == "grammar" and (rules := len(_RULE.findall(str(self.value)))) > MAX_GRAMMAR_RULES:
            raise InvalidGrammar(f"a grammar may define at most {MAX_GRAMMAR_RULES} rules (this engine's limit); "
                                 f"this one defines {rules}")


def _json_document(kind: str, text: str) -> None:
    """Refuse text that is not a JSON object (a schema may also be true or false), or nested deeper than
    MAX_JSON_DEPTH."""
    try:
        doc = json.loads(text)
        depth: int | None = _depth(doc)
    except RecursionError:
        depth = None  # deeper than Python's recursion limit: far past ours
    except ValueError as e:
        raise InvalidGrammar(f"{kind} is not valid JSON: {e}") from None
    if depth is None or depth > MAX_JSON_DEPTH:
        raise InvalidGrammar(f"a {kind.replace('_', ' ')} may nest at most {MAX_JSON_DEPTH} levels (this engine's "
                             f"limit); this one nests {depth if depth is not None else 'deeper than Python parses'}")
    if not isinstance(doc, dict) and not (kind == "json_schema" and isinstance(doc, bool)):
        raise InvalidGrammar(f"{kind} must be a JSON object; got {type(doc).__name__}")


def _depth(doc: Any) -> int:
    """How deeply a parsed JSON document nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(doc, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest



def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise InvalidGrammar("structured output needs xgrammar: pip install xgrammar") from e
    return xgrammar


class GrammarCompiler:
    """Compiles GrammarSpecs against one model's vocabulary; built once per engine.

    `vocab_size` is the model's (the logits' width), which may exceed the tokenizer's length (padded
    embeddings): ids beyond the tokenizer are never allowed. `stop_token_ids` are the engine's EOS ids:
    the only tokens allowed once a grammar is complete. Compiled grammars are cached by xgrammar's
    compiler (keyed by the grammar's text), up to `cache_limit_bytes`; compile is thread-safe, so it can
    run off the step loop."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Collection[int], *,
                 max_threads: int = 2, cache_limit_bytes: int = 256 << 20) -> None:
        if not stop_token_ids:
            raise ValueError("structured output needs at least one stop (EOS) token id")
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True,
                                             cache_limit_bytes=cache_limit_bytes)

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar; InvalidGrammar naming what is wrong if it does not compile."""
        c = self._compiler
        try:
            if spec.kind == "json_object":
                return c.compile_json_schema(ANY_OBJECT_SCHEMA, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "choice":
                # JSON string literals are valid EBNF string literals (same escapes), so any text is safe
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False)
                                                                   for s in spec.value))
            assert isinstance(spec.value, str)  # every other kind: checked on construction
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.value, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "grammar":
                return c.compile_grammar(spec.value)
            return c.compile_structural_tag(spec.value)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input as RuntimeError
            raise InvalidGrammar(f"invalid {spec.kind.replace('_', ' ')}: {_xgr_message(e)}") from None

    def matcher(self, compiled: xgrammar.CompiledGrammar, after: ThinkBlock | None = None) -> GrammarMatcher:
        """A fresh matcher (one per request) at the start of `compiled`; `after`: the think block it follows."""
        return GrammarMatcher(_xgr().GrammarMatcher(compiled), self.stop_token_ids, after)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 CPU bitmask for `rows` logits rows (bit set = token allowed); reuse it every step."""
        return _xgr().allocate_token_bitmask(rows, self.vocab_size)


class GrammarMatcher:
    """One request's position in its grammar: what it has accepted, hence which tokens may come next.

    `after`: the reply's think block (engine/reasoning.py), when the grammar is for the answer after it:
    until the block is over the mask allows everything (and, before the reply's first token, the block's
    start marker beside what the grammar allows), and the scheduler accepts only the answer's tokens."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, stop_token_ids: list[int],
                 after: ThinkBlock | None = None) -> None:
        self._m = matcher
        self._stop_token_ids = stop_token_ids
        self._accepted = 0  # tokens accepted and not rolled back: the most rollback can undo
        self.after = after

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False (state unchanged) if the grammar does not allow it."""
        ok = bool(self._m.accept_token(token_id))
        self._accepted += ok
        return ok

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request should finish ("stop")."""
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (their KV was dropped, or they were speculative)."""
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"can roll back 0..{self._accepted} tokens; asked for {num_tokens}")
        if num_tokens:
            self._m.rollback(num_tokens)
            self._accepted -= num_tokens

    def allowed(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order from the current state, the grammar accepts (none after one that
        completes it); the state is left as it was."""
        count = 0
        for token in tokens:
            if self.is_terminated or not self.accept(token):
                break
            count += 1
        self.rollback(count)
        return count

    def fill_ahead(self, bitmask: torch.Tensor, first: int, tokens: list[int]) -> None:
        """Rows `first` .. `first + len(tokens)` of `bitmask`: row j what may follow `tokens[:j]` (which the
        grammar must accept: see `allowed`); the state is left as it was."""
        for j, token in enumerate(tokens):
            self.fill(bitmask, first + j)
            if not self.accept(token):
                raise ValueError(f"token {token} does not follow the grammar here (cut the drafts with allowed())")
        self.fill(bitmask, first + len(tokens))
        self.rollback(len(tokens))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (only the stop tokens once terminated)."""
        block = self.after
        if block is not None and not block.answering and not block.may_open:
            bitmask[row].fill_(-1)  # thinking: the grammar has not started
            return
        if not self._m.is_terminated():
            self._m.fill_next_token_bitmask(bitmask, row)
            if block is not None and block.may_open:
                _allow(bitmask, row, block.markers.start_id)
            return
        bitmask[row].zero_()
        for t in self._stop_token_ids:
            _allow(bitmask, row, t)


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set token's bit in `bitmask[row]`."""
    word, bit = divmod(token, 32)
    value = int(bitmask[row, word]) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32 two's complement


def fill_bitmask(bitmask: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> list[int]:
    """Fill row i of `bitmask` from `matchers[i]` for every row that has one; the rows to apply, in order.

    Rows without a matcher (unconstrained requests in the same batch) are left as they are and not applied."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    for i in rows:
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill(bitmask, i)
    return rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the disallowed tokens of `logits[rows]` to -inf, in place (float32 [N, vocab], CPU or CUDA).

    The bitmask is copied to the logits' device first when it is not there."""
    if not rows:
        return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(logits.shape[-1], bitmask.shape[-1] * 32),
                                       indices=list(rows))


def _xgr_message(error: Exception) -> str:
    """xgrammar's message without its source location, first line only, bounded."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    return _XGR_PREFIX.sub("", lines[0]).strip()[:500]
