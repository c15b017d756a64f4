"""The request's tool fields: valid ones parsed as OpenAI defines them, every
mistake a 400 naming the field at fault."""

from __future__ import annotations

import copy

import grpc
import pytest

from gateway.errors import GatewayError
from gateway.tool_calls import FunctionTool, parse_tool_request
from gateway.tool_calls.limits import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, MAX_TOOLS
from tests.gateway.tool_calls.helpers import NO_ARGS, SEARCH, TOOLS, WEATHER


def _fn(name="f", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


def _with(tool: dict, **changes) -> dict:
    changed = copy.deepcopy(tool)
    changed["function"].update(changes)
    return changed


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def test_tools_are_parsed_in_order_with_their_fields():
    request = parse_tool_request(TOOLS)
    assert request is not None
    assert [t.name for t in request.tools] == ["get_weather", "search", "now"]
    assert request.choice == "auto" and request.named is None and request.parallel is True
    weather = request.tool("get_weather")
    assert weather.description == "The weather in a city"
    assert weather.parameters == WEATHER["function"]["parameters"]
    assert request.template_tools() == TOOLS  # as sent: the chat template sees what the client wrote


@pytest.mark.parametrize(("choice", "kind", "named"), [
    ("none", "none", None),
    ("auto", "auto", None),
    ("required", "required", None),
    ({"type": "function", "function": {"name": "search"}}, "named", "search"),
])
def test_tool_choice_values(choice, kind, named):
    request = parse_tool_request(TOOLS, choice, False)
    assert request is not None
    assert (request.choice, request.named, request.parallel) == (kind, named, False)


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_no_tools_means_no_tool_request(choice):
    assert parse_tool_request(None, choice, True) is None


def test_arguments_schema_makes_the_object_type_explicit():
    assert FunctionTool("f").arguments_schema == {"type": "object", "properties": {}, "additionalProperties": False}
    untyped = FunctionTool("f", parameters={"properties": {"a": {"type": "integer"}}})
    assert untyped.arguments_schema == {"type": "object", "properties": {"a": {"type": "integer"}}}
    typed = FunctionTool("f", parameters=SEARCH["function"]["parameters"])
    assert typed.arguments_schema is SEARCH["function"]["parameters"]


def test_the_largest_allowed_request_is_accepted():
    tools = [_fn(f"t{i}", parameters={"type": "object"}) for i in range(MAX_TOOLS)]
    tools[0]["function"]["name"] = "a" * 64
    request = parse_tool_request(tools)
    assert request is not None and len(request.tools) == MAX_TOOLS


_BIG_SCHEMA = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
_QUARTER_SCHEMA = {"type": "object", "description": "x" * (MAX_SCHEMA_BYTES - 100)}

BAD_REQUESTS = [
    # (id, tools, tool_choice, parallel_tool_calls, param)
    ("tools not a list", {"type": "function"}, None, None, "tools"),
    ("tools empty", [], None, None, "tools"),
    ("too many tools", [_fn(f"t{i}") for i in range(MAX_TOOLS + 1)], None, None, "tools"),
    ("tool not an object", [WEATHER, "search"], None, None, "tools[1]"),
    ("tool type missing", [{"function": {"name": "f"}}], None, None, "tools[0].type"),
    ("tool type not function", [{"type": "code_interpreter", "function": {"name": "f"}}], None, None,
     "tools[0].type"),
    ("unknown key in tool", [{**_fn(), "extra": 1}], None, None, "tools[0].extra"),
    ("function missing", [{"type": "function"}], None, None, "tools[0].function"),
    ("function not an object", [{"type": "function", "function": "f"}], None, None, "tools[0].function"),
    ("unknown key in function", [_fn(parameter={})], None, None, "tools[0].function.parameter"),
    ("name missing", [WEATHER, {"type": "function", "function": {"description": "d"}}], None, None,
     "tools[1].function.name"),
    ("name not a string", [_fn(7)], None, None, "tools[0].function.name"),
    ("name empty", [_fn("")], None, None, "tools[0].function.name"),
    ("name too long", [_fn("a" * 65)], None, None, "tools[0].function.name"),
    ("name with a space", [_fn("get weather")], None, None, "tools[0].function.name"),
    ("name with a dot", [_fn("a.b")], None, None, "tools[0].function.name"),
    ("name not ascii", [_fn("café")], None, None, "tools[0].function.name"),
    ("duplicate names", [WEATHER, SEARCH, _with(NO_ARGS, name="search")], None, None, "tools[2].function.name"),
    ("description not a string", [_fn(description=["d"])], None, None, "tools[0].function.description"),
    ("description too long", [_fn(description="d" * 8193)], None, None, "tools[0].function.description"),
    ("strict not a boolean", [_fn(strict="true")], None, None, "tools[0].function.strict"),
    ("parameters not an object", [_fn(parameters="{}")], None, None, "tools[0].function.parameters"),
    ("parameters a list", [_fn(parameters=[{"type": "object"}])], None, None, "tools[0].function.parameters"),
    ("parameters not a JSON schema", [_fn(parameters={"type": "objekt"})], None, None,
     "tools[0].function.parameters"),
    ("parameters properties not an object", [_fn(parameters={"type": "object", "properties": []})], None, None,
     "tools[0].function.parameters"),
    ("parameters required not a list", [_fn(parameters={"type": "object", "required": "a"})], None, None,
     "tools[0].function.parameters"),
    ("parameters bad for their draft-7 $schema",
     [_fn(parameters={"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                      "additionalProperties": 3})], None, None, "tools[0].function.parameters"),
    ("parameters with a malformed $schema", [_fn(parameters={"$schema": 12, "type": "object"})], None, None,
     "tools[0].function.parameters"),
    ("parameters not of type object", [_fn(parameters={"type": "string"})], None, None,
     "tools[0].function.parameters.type"),
    ("parameters too large", [_fn(parameters=_BIG_SCHEMA)], None, None, "tools[0].function.parameters"),
    ("parameters nested too deeply", [_fn(parameters=_deep_schema(MAX_SCHEMA_DEPTH))], None, None,
     "tools[0].function.parameters"),
    ("parameters NaN", [_fn(parameters={"type": "object", "maximum": float("nan")})], None, None,
     "tools[0].function.parameters"),
    ("schemas together too large", [_fn(f"t{i}", parameters=_QUARTER_SCHEMA) for i in range(5)], None, None,
     "tools"),
    ("tool_choice unknown word", TOOLS, "any", None, "tool_choice"),
    ("tool_choice a number", TOOLS, 1, None, "tool_choice"),
    ("tool_choice wrong type", TOOLS, {"type": "tool", "function": {"name": "search"}}, None, "tool_choice.type"),
    ("tool_choice without function", TOOLS, {"type": "function"}, None, "tool_choice.function"),
    ("tool_choice function without name", TOOLS, {"type": "function", "function": {}}, None,
     "tool_choice.function.name"),
    ("tool_choice names no tool", TOOLS, {"type": "function", "function": {"name": "nope"}}, None,
     "tool_choice.function.name"),
    ("tool_choice unknown key", TOOLS, {"type": "function", "function": {"name": "search"}, "x": 1}, None,
     "tool_choice.x"),
    ("tool_choice function unknown key", TOOLS, {"type": "function", "function": {"name": "search", "a": 1}},
     None, "tool_choice.function.a"),
    ("required without tools", None, "required", None, "tool_choice"),
    ("named without tools", None, {"type": "function", "function": {"name": "search"}}, None, "tool_choice"),
    ("tool_choice malformed without tools", None, "sometimes", None, "tool_choice"),
    ("parallel_tool_calls a string", TOOLS, None, "false", "parallel_tool_calls"),
    ("parallel_tool_calls a number", TOOLS, None, 0, "parallel_tool_calls"),
    ("parallel_tool_calls a string without tools", None, None, "true", "parallel_tool_calls"),
]


@pytest.mark.parametrize(("tools", "choice", "parallel", "param"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_a_mistake_is_a_400_naming_the_field(tools, choice, parallel, param):
    with pytest.raises(GatewayError) as raised:
        parse_tool_request(tools, choice, parallel)
    error = raised.value
    assert (error.status, error.grpc_code, error.type) == (400, grpc.StatusCode.INVALID_ARGUMENT,
                                                           "invalid_request_error")
    assert error.param == param
    assert error.message.startswith(param.split("[")[0])
    assert len(error.message) < 400  # a client's long value is quoted cut short
    assert error.to_openai()["error"]["param"] == param


def test_schema_messages_say_where_in_the_schema():
    with pytest.raises(GatewayError) as raised:
        parse_tool_request([_fn(parameters={"type": "object", "properties": {"a": {"type": 5}}})])
    assert "properties" in raised.value.message and raised.value.code == "invalid_function_parameters"


def test_a_format_keyword_is_not_judged_with_pythons_regex_dialect():
    # "pattern" is a regex in the grammar backend's dialect, not Python's: left to the engine.
    parse_tool_request([_fn(parameters={"type": "object", "properties": {"a": {"type": "string",
                                                                                "pattern": "\\p{L}+"}}})])
