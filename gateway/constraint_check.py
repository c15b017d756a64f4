"""What the gateway can tell of a constraint without the grammar compiler:
a JSON schema against its meta-schema (jsonschema), a regex that is
certainly malformed, the size of a grammar. Whatever only xgrammar can
judge is refused by the engine pod at submit (INVALID_ARGUMENT, before any
token), which the pipeline turns into the same 400 (gateway/structured_output.py).

Nothing is refused here that the engine would accept: xgrammar's regex
dialect is not Python's, so only the errors both parsers agree on count.
"""

from __future__ import annotations

import functools
import json
import re
import warnings

import jsonschema

from tessera.structured_output import StructuredOutputsParams

# Regex and grammar text the API takes: far above any real constraint, well
# below what would make a request's parsing a denial of service.
MAX_CONSTRAINT_CHARS = 256 * 1024
# Python `re` errors that xgrammar raises too, whatever the dialect: unbalanced
# groups, a quantifier with nothing (or another quantifier) before it, a
# reversed {m,n}. Others (escapes, character ranges, group syntax) differ
# between the dialects and are left to the engine.
_CERTAIN_REGEX_ERRORS = ("missing ), unterminated subpattern", "unbalanced parenthesis", "nothing to repeat",
                         "multiple repeat", "min repeat greater than max repeat", "unterminated character set")
# Python reads a "]" first in a class as a literal, xgrammar as the class's
# end: where one appears the two parse the rest differently.
_DIALECT_CLASS_START = re.compile(r"\[\^?\]")


@functools.lru_cache(maxsize=512)
def check(params: StructuredOutputsParams) -> None:
    """ValueError naming the field ("structured_outputs.<kind>: ...") for a
    constraint that certainly fails; silent when unsure. Cached by
    constraint: clients send the same schema again and again."""
    if params.kind == "json":
        _check_schema(params)
    elif params.kind in ("regex", "grammar"):
        text = getattr(params, params.kind)
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs.{params.kind}: longer than {MAX_CONSTRAINT_CHARS} characters")
        if params.kind == "regex":
            _check_regex(text)


def _check_schema(params: StructuredOutputsParams) -> None:
    schema = params.json if isinstance(params.json, dict) else json.loads(params.json)
    validator = _meta_validator(schema)
    try:
        # No format checks: the meta-schema's "format": "regex" would judge a
        # schema's `pattern` with Python's dialect (the engine's is xgrammar's).
        validator.check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as e:
        where = "".join(f"[{p!r}]" for p in e.absolute_path)
        raise ValueError(f"structured_outputs.json: invalid JSON schema: {e.message}"
                         + (f" (at schema{where})" if where else "")) from None


def _meta_validator(schema: dict) -> type[jsonschema.protocols.Validator]:
    """The draft its $schema names (the latest when absent or unknown, as
    xgrammar reads any schema); a malformed $schema then fails the meta-schema."""
    uri = schema.get("$schema")
    if isinstance(uri, str):
        try:
            return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        except ValueError:  # a string no URI parser takes
            pass
    return jsonschema.Draft202012Validator


def _check_regex(pattern: str) -> None:
    if _DIALECT_CLASS_START.search(pattern):
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FutureWarning: "possible nested set"
            re.compile(pattern)
    except re.error as e:
        if e.msg.startswith(_CERTAIN_REGEX_ERRORS):
            where = f" at position {e.pos}" if e.pos is not None else ""
            raise ValueError(f"structured_outputs.regex: invalid regex: {e.msg}{where}") from None
    except (RecursionError, OverflowError):
        pass  # the engine's parser decides
