"""The xgrammar backend: constraints parsed into grammars, compiled against
the model's vocabulary, and matched token by token.

Parsing needs no tokenizer, so the engine's admission checks validate with
``parse`` (cached) when a request is submitted: a constraint xgrammar
refuses is INVALID_ARGUMENT before any token, which the gateway (whose own
checks are light: gateway/constraint_check.py) passes on as a 400 naming
the client's field. Compiling builds the per-token masks and runs in the
engine core's compile threads.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from tessera.structured_output import StructuredOutputsParams

# JSON without free whitespace and with compact separators: a model that
# may emit whitespace between tokens forever (random weights, or a real
# model in a loop) cannot, and outputs stay short.
_JSON_FORMAT = {"any_whitespace": False, "separators": (",", ":")}
# xgrammar prefixes its messages with a timestamp and C++ source location.
_LOCATION_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
# A character of a string with minLength or maxLength, as xgrammar (0.2.9)
# writes it: any but a quote, a backslash, CR or LF, so a raw control
# character (U+0000-U+001F) too, which JSON forbids: a sampling model that
# draws one writes output no JSON parser reads (a tool call's arguments
# among them). Its unbounded strings already exclude them; bounded ones are
# made to as well.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _clean(error: Exception) -> str:
    return _LOCATION_PREFIX.sub("", str(error).strip()).strip()


@functools.lru_cache(maxsize=512)
def parse(params: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as an xgrammar Grammar; ValueError naming the field
    when the schema, regex or grammar is malformed."""
    kind = params.kind
    try:
        if kind == "json":
            return _json_grammar(xgr.Grammar.from_json_schema(params.spec, **_JSON_FORMAT))
        if kind == "json_object":
            # Not strict: any properties, any values.
            return _json_grammar(xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **_JSON_FORMAT))
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError) as e:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice list"}.get(kind, kind)
        raise ValueError(f"structured_outputs.{kind}: invalid {what}: {_clean(e)}") from None


def _json_grammar(grammar: xgr.Grammar) -> xgr.Grammar:
    """A JSON schema's grammar whose strings hold no raw control character."""
    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


def validate(params: StructuredOutputsParams) -> None:
    """Raise ValueError unless the constraint parses (cached by constraint)."""
    parse(params)


class XgrammarBackend:
    """Compiles constraints for one model: its tokenizer, its logits width
    (``vocab_size``, which may exceed the tokenizer's) and its stop tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int],
                 max_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        # Our own cache (manager.py) keys compiled grammars; xgrammar's would
        # only hold a second copy.
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return self.compiler.compile_grammar(parse(params))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(vocab_size / 32)] int32, every token allowed."""
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


@dataclass
class Grammar:
    """One request's matcher over its compiled grammar."""

    matcher: xgr.GrammarMatcher

    @classmethod
    def create(cls, compiled: xgr.CompiledGrammar) -> Grammar:
        return cls(xgr.GrammarMatcher(compiled))

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over sampled tokens; False (and stop there) on one the
        grammar refuses."""
        return all(self.matcher.accept_token(t) for t in token_ids)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens the grammar accepts, leaving the matcher
        where it was (for speculative drafts)."""
        accepted = 0
        for t in token_ids:
            if not self.matcher.accept_token(t):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_bitmasks(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> int:
        """Fill rows first_row + i (i = 0..len(drafts)) with the mask after
        accepting drafts[:i], then roll back: the masks a verifier needs for
        each drafted position and the bonus one. Rows past a draft the
        grammar refuses stay all-allowed (the verifier stops there anyway).
        Returns the number of rows filled."""
        accepted = 0
        self.fill_bitmask(bitmask, first_row)
        for i, t in enumerate(drafts):
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            accepted += 1
            self.fill_bitmask(bitmask, first_row + i + 1)
        if accepted:
            self.matcher.rollback(accepted)
        return accepted + 1

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
