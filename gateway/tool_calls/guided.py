"""tool_choice "required" and a named function, enforced with guided decoding:
the constraint (a JSON schema) the engine decodes under, and the reading of
what it produced. The grammar makes every complete output parse, and every
call's arguments match its function's schema.

- A named function: the model writes the arguments object, under the
  function's `parameters` schema.
- "required": the model writes a JSON array of one or more calls (exactly
  one with parallel_tool_calls false), each `{"name": <one tool>,
  "arguments": <that tool's parameters>}` (anyOf over the tools). "name"
  comes first, so a stream names the call before its arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.tool_calls.calls import ParsedOutput, new_call_id
from gateway.tool_calls.definitions import FunctionTool, ToolRequest
from gateway.tool_calls.guided_output import NamedCallParser, RequiredCallsParser
from gateway.tool_calls.parser_base import ToolCallParser
from tessera.structured_output import StructuredOutputsParams

# Values that are data, not schemas: a "$ref" inside them is no reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Keywords whose value maps names (any names, "enum" or "$ref" included) to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def guided_constraint(request: ToolRequest) -> StructuredOutputsParams | None:
    """The guided-decoding constraint of `request`: a schema for "required"
    and a named function, None for "auto" and "none"."""
    if request.choice == "named":
        assert request.named is not None
        return StructuredOutputsParams(json=named_schema(request.tool(request.named)))
    if request.choice == "required":
        return StructuredOutputsParams(json=required_schema(request.tools, request.parallel))
    return None


def named_schema(tool: FunctionTool) -> dict[str, Any]:
    """The output of a named function: its arguments object."""
    return tool.arguments_schema


def required_schema(tools: tuple[FunctionTool, ...], parallel: bool) -> dict[str, Any]:
    """The output of "required": an array of calls of the tools."""
    calls = [_call_schema(tool, f"#/items/anyOf/{i}/properties/arguments") for i, tool in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _call_schema(tool: FunctionTool, arguments_at: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.name]},
            "arguments": _relocated(tool.arguments_schema, arguments_at),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _relocated(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    """`schema` as a part of a larger one at `pointer` ("#/items/..."): its
    local references ("#", "#/$defs/x") made to point where they pointed;
    "$schema" and "$id", which only a document's root may carry, dropped."""
    moved = {key: value for key, value in schema.items() if key not in ("$schema", "$id")}
    return _rebased(moved, pointer)


def _rebased(value: Any, pointer: str) -> Any:
    # Depth is bounded by the definitions' check (MAX_SCHEMA_DEPTH): recursion is safe.
    if isinstance(value, list):
        return [_rebased(item, pointer) for item in value]
    if not isinstance(value, dict):
        return value
    rebased: dict[str, Any] = {}
    for key, item in value.items():
        if key == "$ref" and isinstance(item, str) and (item == "#" or item.startswith("#/")):
            rebased[key] = pointer + item[1:]
        elif key in _DATA_KEYWORDS:
            rebased[key] = item
        elif key in _SCHEMA_MAPS and isinstance(item, dict):
            rebased[key] = {name: _rebased(schema, pointer) for name, schema in item.items()}
        else:
            rebased[key] = _rebased(item, pointer)
    return rebased


def guided_parser(request: ToolRequest, make_id: Callable[[], str] = new_call_id) -> ToolCallParser:
    """The parser of one choice's guided output ("required" or named)."""
    if request.choice == "named":
        assert request.named is not None
        return NamedCallParser(request.named, make_id=make_id)
    if request.choice == "required":
        return RequiredCallsParser(request.names, parallel=request.parallel, make_id=make_id)
    raise ValueError(f"tool_choice {request.choice!r} is not guided")


def parse_guided_output(text: str, request: ToolRequest, make_id: Callable[[], str] = new_call_id) -> ParsedOutput:
    """The calls in a whole guided output (non-streaming)."""
    return guided_parser(request, make_id).parse(text)
