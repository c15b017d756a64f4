"""The gateway's light constraint checks (gateway/constraint_check.py): they
refuse what is certainly malformed and never what the engine's grammar
compiler (xgrammar, imported here only to compare) would accept."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from gateway.constraint_check import MAX_CONSTRAINT_CHARS, check
from tessera.structured_output import StructuredOutputsParams

# Malformed for Python's `re` and for xgrammar alike.
CERTAINLY_BAD = ["(ab", "ab)", "((a)", "[a-", "*a", "+", "a|*b", "a**", "a?*", "a{2}{3}", "a{2,1}", "^*"]
# Python's `re` refuses these, xgrammar takes them: the dialects differ.
XGRAMMAR_ONLY = [r"(?<x>a)", "[^]", "([^])", r"\Q", r"\z", r"[\d-z]", r"\x4g"]
# Python takes these, xgrammar does not: the engine refuses them.
PYTHON_ONLY = [r"(?=a)a", r"(?<=a)b", r"(a)\1", r"\bfoo", "a{,3}", "a++", r"(?i)a", "{"]


def _xgrammar_accepts(pattern: str) -> bool:
    try:
        xgr.Grammar.from_regex(pattern)
    except (RuntimeError, ValueError):
        return False
    return True


@pytest.mark.parametrize("pattern", CERTAINLY_BAD)
def test_certainly_bad_regex_is_refused(pattern):
    assert not _xgrammar_accepts(pattern)
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: invalid regex: "):
        check(StructuredOutputsParams(regex=pattern))


@pytest.mark.parametrize("pattern", XGRAMMAR_ONLY + PYTHON_ONLY + [r"\d{3}-[a-z]+", "(cat|dog) [0-9]{1,2}", "a|"])
def test_the_gateway_never_refuses_a_regex_xgrammar_accepts(pattern):
    expected = pattern not in PYTHON_ONLY
    assert _xgrammar_accepts(pattern) is expected  # the corpus says what it claims
    check(StructuredOutputsParams(regex=pattern))  # left to the engine either way


@pytest.mark.parametrize("schema,where", [
    ({"type": 5}, "schema['type']"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}, "['minimum']"),
    ({"type": "object", "required": "a"}, "['required']"),
    ({"$schema": 5}, "['$schema']"),
])
def test_schema_against_the_meta_schema(schema, where):
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: invalid JSON schema: ") as err:
        check(StructuredOutputsParams(json=schema))
    assert where in str(err.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]},
    # A pattern in xgrammar's dialect, not Python's: not judged here.
    {"type": "string", "pattern": r"\p{L}+"},
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "integer"},
    {"$schema": "https://example.com/unknown", "type": "integer"},
    # Malformed only for the grammar compiler (an unresolvable $ref): the engine refuses it.
    {"properties": {"a": {"$ref": "#/nope"}}},
])
def test_valid_schemas_pass(schema):
    check(StructuredOutputsParams(json=schema))


def test_grammar_and_regex_size():
    check(StructuredOutputsParams(grammar="root ::= nothing"))  # syntax is the engine's to judge
    for kind in ("grammar", "regex"):
        with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind}: longer than {MAX_CONSTRAINT_CHARS}"):
            check(StructuredOutputsParams(**{kind: "a" * (MAX_CONSTRAINT_CHARS + 1)}))


def test_choice_and_json_object_need_no_compiler():
    check(StructuredOutputsParams(choice=["a", "b"]))
    check(StructuredOutputsParams(json_object=True))
    with pytest.raises(ValueError, match="the list of choices is empty"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="must be a list of strings"):
        StructuredOutputsParams(choice="yes")
