"""tool_choice "required" and a named function: the guided-decoding schemas
accept the outputs they should and refuse the others, and guided output
turns into calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.constraint_check import check
from gateway.tool_calls import guided_constraint, parse_guided_output, parse_tool_request
from gateway.tool_calls.guided import named_schema, required_schema
from tests.gateway.tool_calls.helpers import TOOLS, counting_ids

WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
SEARCH_CALL = {"name": "search", "arguments": {"query": "tessera", "limit": 3}}
NOW_CALL = {"name": "now", "arguments": {}}
REF_TOOL = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {"guest": {"$ref": "#/$defs/person"}, "guests": {"type": "array",
                                                                           "items": {"$ref": "#/$defs/person"}}},
            "required": ["guest"],
            "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string"}},
                                 "required": ["name"]}},
        },
    },
}


def _request(choice="required", parallel=True, tools=TOOLS):
    request = parse_tool_request(tools, choice, parallel)
    assert request is not None
    return request


def _valid(schema: dict, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@pytest.mark.parametrize("calls", [[WEATHER_CALL], [SEARCH_CALL, WEATHER_CALL], [NOW_CALL, NOW_CALL]])
def test_required_schema_accepts_calls_of_the_tools(calls):
    assert _valid(required_schema(_request().tools, parallel=True), calls)


@pytest.mark.parametrize("output", [
    [],
    {"name": "search", "arguments": {"query": "q"}},  # not in an array
    [{"name": "other", "arguments": {}}],  # no such tool
    [{"name": "get_weather", "arguments": {"query": "q"}}],  # another tool's arguments
    [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "K"}}],  # outside its enum
    [{"name": "search"}],  # no arguments
    [{"name": "now", "arguments": {"x": 1}}],  # a function without parameters takes none
    [{"name": "search", "arguments": {"query": "q"}, "id": "x"}],  # more than name and arguments
    [{"name": "search", "arguments": "{\"query\": \"q\"}"}],  # arguments as a string
], ids=["empty", "bare object", "unknown name", "other tool's arguments", "enum", "no arguments",
        "arguments for none", "extra key", "string arguments"])
def test_required_schema_refuses_what_is_no_call_of_the_tools(output):
    assert not _valid(required_schema(_request().tools, parallel=True), output)


def test_parallel_tool_calls_false_allows_exactly_one_call():
    schema = required_schema(_request().tools, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert _valid(schema, [WEATHER_CALL])
    assert not _valid(schema, [WEATHER_CALL, SEARCH_CALL])
    assert "maxItems" not in required_schema(_request().tools, parallel=True)


def test_required_schema_puts_name_first_so_streams_name_the_call_early():
    for case in required_schema(_request().tools, parallel=True)["items"]["anyOf"]:
        assert list(case["properties"]) == ["name", "arguments"]


def test_references_still_resolve_inside_the_required_schema():
    request = _request(tools=[REF_TOOL, *TOOLS])
    schema = required_schema(request.tools, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "book", "arguments": {"guest": {"name": "Ada"}, "guests": [{"name": "Bo"}]}}]
    assert _valid(schema, good)
    assert not _valid(schema, [{"name": "book", "arguments": {"guest": {"nom": "Ada"}}}])
    assert not _valid(schema, [{"name": "book", "arguments": {"guest": {"name": "A"}, "guests": [{}]}}])
    embedded = schema["items"]["anyOf"][0]["properties"]["arguments"]
    assert "$schema" not in embedded  # only a document's root may say its draft
    assert REF_TOOL["function"]["parameters"]["properties"]["guest"]["$ref"] == "#/$defs/person"  # not mutated


def test_named_schema_is_the_functions_parameters():
    request = _request({"type": "function", "function": {"name": "get_weather"}})
    schema = named_schema(request.tool("get_weather"))
    assert schema == TOOLS[0]["function"]["parameters"]
    assert _valid(schema, WEATHER_CALL["arguments"])
    assert not _valid(schema, {"unit": "C"})
    assert not _valid(schema, ["Paris"])
    no_args = named_schema(request.tool("now"))
    assert _valid(no_args, {}) and not _valid(no_args, {"a": 1}) and not _valid(no_args, "x")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_constraints_pass_the_gateways_own_schema_check(choice):
    constraint = guided_constraint(_request(choice, tools=[REF_TOOL, *TOOLS]))
    assert constraint is not None and constraint.kind == "json"
    check(constraint)  # the light check every other guided request gets
    json.loads(constraint.spec)


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_are_not_guided(choice):
    assert guided_constraint(_request(choice)) is None


def test_required_output_becomes_calls_with_arguments_as_written():
    text = '[{"name": "search", "arguments": {"query": "tessera", "limit": 3}}, {"name":"now","arguments":{}}]'
    output = parse_guided_output(text, _request(), counting_ids())
    assert output.content is None
    assert [(c.id, c.name, c.arguments_json) for c in output.tool_calls] == [
        ("call_0", "search", '{"query": "tessera", "limit": 3}'), ("call_1", "now", "{}")]
    for call in output.tool_calls:
        jsonschema.validate(json.loads(call.arguments_json), _request().tool(call.name).arguments_schema)


def test_named_output_becomes_one_call():
    request = _request({"type": "function", "function": {"name": "get_weather"}})
    output = parse_guided_output('  {"city": "Paris"}\n', request, counting_ids())
    assert output.content is None
    assert [(c.id, c.name, c.arguments_json) for c in output.tool_calls] == [
        ("call_0", "get_weather", '{"city": "Paris"}')]


def test_a_cut_guided_output_keeps_what_was_read():
    output = parse_guided_output('[{"name": "search", "arguments": {"query": "tess', _request(), counting_ids())
    assert [(c.name, c.arguments_json) for c in output.tool_calls] == [("search", '{"query": "tess')]
    assert parse_guided_output('[{"name": "sea', _request()).tool_calls == ()
    assert parse_guided_output("", _request()).tool_calls == ()


def test_ids_look_like_openais():
    output = parse_guided_output('[{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}]',
                                 _request())
    ids = [call.id for call in output.tool_calls]
    assert len(set(ids)) == 2
    for call_id in ids:
        assert call_id.startswith("call_") and len(call_id) == 29 and call_id[5:].isalnum()
