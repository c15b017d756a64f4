"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked
as OpenAI defines them: every mistake is a 400 whose `param` names the field
at fault (``tools[2].function.name``), and everything a client controls is
bounded (gateway/tool_calls/limits.py).

Unknown keys are refused, as the rest of the API refuses unknown fields, so a
typo never silently drops a part of a tool.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema  # type: ignore[import-untyped]  # no stubs installed

from gateway.errors import GatewayError, bad_request
from gateway.tool_calls.limits import (
    MAX_DESCRIPTION_CHARS,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_TOOLS,
    MAX_TOTAL_SCHEMA_BYTES,
    TOOL_NAME_RULE,
)

ChoiceKind = Literal["none", "auto", "required", "named"]
_CHOICE_WORDS = ("none", "auto", "required")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_CHOICE_KEYS = frozenset({"type", "function"})
# How much of a client's value an error message quotes.
_QUOTE_CHARS = 80


@dataclass(frozen=True)
class FunctionTool:
    """One function the model may call (OpenAI's `{"type": "function", "function": {...}}`)."""

    name: str
    """Unique within the request; matches ^[a-zA-Z0-9_-]{1,64}$."""
    description: str | None = None
    """What the function does, for the chat template; None when not given."""
    parameters: dict[str, Any] | None = None
    """The JSON Schema of the arguments object as the client sent it (checked
    against its meta-schema; its type, when given, is "object"); None when
    not given. Shared, not copied: nobody may mutate it."""
    strict: bool | None = None
    """OpenAI's strict flag, accepted and kept for the chat template: `required`
    and a named function are always enforced by guided decoding, `auto` never."""

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """The schema the arguments object must match: `parameters` with
        "type": "object" made explicit (a schema without a type would let a
        model write a string); no parameters means no arguments: `{}`."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        if "type" in self.parameters:
            return self.parameters
        return {"type": "object", **self.parameters}

    def to_openai(self) -> dict[str, Any]:
        """The tool in OpenAI's shape, as chat templates take it (`tools=`)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tool calling, checked."""

    tools: tuple[FunctionTool, ...]
    """The functions, in the request's order; may be empty only with choice "none" or "auto"."""
    choice: ChoiceKind
    """"none": no calls; "auto": the model decides and a parser finds its calls;
    "required": at least one call; "named": exactly one call of `named`."""
    named: str | None = None
    """The function tool_choice names (choice "named"), else None."""
    parallel: bool = True
    """parallel_tool_calls: False allows at most one call."""

    @property
    def names(self) -> frozenset[str]:
        """The names of the functions."""
        return frozenset(tool.name for tool in self.tools)

    def tool(self, name: str) -> FunctionTool:
        """The function called `name` (KeyError when there is none)."""
        for tool in self.tools:
            if tool.name == name:
                return tool
        raise KeyError(name)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (`tools=`), None when there are none."""
        return [tool.to_openai() for tool in self.tools] or None


def parse_tool_request(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolRequest | None:
    """The checked tool settings of a chat request's raw JSON values (None
    where a field is absent), or None when the request uses no tools. Raises
    a 400 GatewayError naming the field at fault."""
    parallel = _parallel(parallel_tool_calls)
    if tools is None:
        _check_choice_without_tools(tool_choice)
        return None
    parsed = _tools(tools)
    kind, named = _choice(tool_choice, frozenset(tool.name for tool in parsed))
    return ToolRequest(parsed, kind, named, parallel)


def _parallel(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise _wrong_type("parallel_tool_calls", "a boolean", value)
    return value


def _check_choice_without_tools(tool_choice: Any) -> None:
    """Without tools only "none" and "auto" mean anything (nothing to call);
    anything else is a mistake, or a malformed value, said as such."""
    if tool_choice is None:
        return
    kind, _ = _choice(tool_choice, frozenset(), tools_given=False)
    if kind not in ("none", "auto"):
        raise bad_request(f"tool_choice: {kind!r} needs tools", "invalid_value", "tool_choice")


def _tools(value: Any) -> tuple[FunctionTool, ...]:
    if not isinstance(value, list):
        raise _wrong_type("tools", "a list of tools", value)
    if not value:
        raise bad_request("tools: the list is empty; leave tools out instead", "invalid_value", "tools")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"tools: {len(value)} tools, at most {MAX_TOOLS} are allowed", "invalid_value", "tools")
    parsed: list[FunctionTool] = []
    seen: set[str] = set()
    total_bytes = 0
    for i, item in enumerate(value):
        tool, schema_bytes = _tool(item, f"tools[{i}]")
        if tool.name in seen:
            raise bad_request(f"tools[{i}].function.name: {tool.name!r} is already the name of another tool",
                              "invalid_value", f"tools[{i}].function.name")
        seen.add(tool.name)
        total_bytes += schema_bytes
        if total_bytes > MAX_TOTAL_SCHEMA_BYTES:
            raise bad_request(f"tools: the parameters schemas together exceed {MAX_TOTAL_SCHEMA_BYTES} bytes",
                              "invalid_value", "tools")
        parsed.append(tool)
    return tuple(parsed)


def _tool(item: Any, where: str) -> tuple[FunctionTool, int]:
    """One tool and the size of its schema in bytes."""
    if not isinstance(item, dict):
        raise _wrong_type(where, "an object", item)
    _refuse_unknown_keys(item, _TOOL_KEYS, where)
    if "type" not in item:
        raise _missing(f"{where}.type")
    if item["type"] != "function":
        raise bad_request(f"{where}.type: only \"function\" tools are supported, got {_quote(item['type'])}",
                          "invalid_value", f"{where}.type")
    function = item.get("function")
    if function is None:
        raise _missing(f"{where}.function")
    if not isinstance(function, dict):
        raise _wrong_type(f"{where}.function", "an object", function)
    where = f"{where}.function"
    _refuse_unknown_keys(function, _FUNCTION_KEYS, where)
    name = _name(function.get("name"), f"{where}.name")
    description = _optional(function, "description", str, "a string", where)
    if description is not None and len(description) > MAX_DESCRIPTION_CHARS:
        raise bad_request(f"{where}.description: longer than {MAX_DESCRIPTION_CHARS} characters",
                          "invalid_value", f"{where}.description")
    strict = _optional(function, "strict", bool, "a boolean", where)
    parameters = _optional(function, "parameters", dict, "a JSON Schema object", where)
    schema_bytes = 0 if parameters is None else _check_parameters(parameters, f"{where}.parameters")
    return FunctionTool(name, description, parameters, strict), schema_bytes


def _name(value: Any, where: str) -> str:
    if value is None:
        raise _missing(where)
    if not isinstance(value, str):
        raise _wrong_type(where, "a string", value)
    if not TOOL_NAME_RULE.fullmatch(value):
        raise bad_request(f"{where}: must be 1 to 64 letters, digits, underscores or dashes "
                          f"(^[a-zA-Z0-9_-]{{1,64}}$), got {_quote(value)}", "invalid_value", where)
    return value


def _optional(obj: dict[str, Any], key: str, kind: type, what: str, where: str) -> Any:
    value = obj.get(key)
    # bool is an int in Python, and JSON's true is no string nor object: exact types only.
    if value is not None and type(value) is not kind:
        raise _wrong_type(f"{where}.{key}", what, value)
    return value


def _check_parameters(schema: dict[str, Any], where: str) -> int:
    """Bounds, then the meta-schema; the schema's size in bytes."""
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise bad_request(f"{where}: nested deeper than {MAX_SCHEMA_DEPTH} levels", "invalid_function_parameters",
                          where)
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise bad_request(f"{where}: not valid JSON (NaN or Infinity)", "invalid_function_parameters",
                          where) from None
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        raise bad_request(f"{where}: {size} bytes, at most {MAX_SCHEMA_BYTES} are allowed",
                          "invalid_function_parameters", where)
    problem = _schema_problem(text)
    if problem is not None:
        raise bad_request(f"{where}: {problem}", "invalid_function_parameters", where)
    kind = schema.get("type")
    if kind is not None and kind != "object":
        raise bad_request(f"{where}.type: the arguments are a JSON object: the type must be \"object\", "
                          f"got {_quote(kind)}", "invalid_function_parameters", f"{where}.type")
    return size


def _depth(value: Any) -> int:
    """Nesting of objects and arrays, without recursion (a client chooses the depth)."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                return depth
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)
    return deepest


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str | None:
    """Why the schema fails its meta-schema, or None. Cached by text: agents
    send the same tools with every turn."""
    schema = json.loads(text)
    validator = _meta_validator(schema)
    try:
        # No format checks: "format": "regex" would judge a `pattern` with
        # Python's dialect, and the grammar backend's is another.
        validator.check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as e:
        at = "".join(f"[{p!r}]" for p in e.absolute_path)
        return f"not a valid JSON Schema: {e.message[:200]}" + (f" (at parameters{at})" if at else "")
    return None


def _meta_validator(schema: dict[str, Any]) -> type[jsonschema.protocols.Validator]:
    """The draft its $schema names; Draft 2020-12 when absent or unknown."""
    if isinstance(schema.get("$schema"), str):
        try:
            return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        except ValueError:  # a string no URI parser takes: the meta-schema then refuses it
            pass
    return jsonschema.Draft202012Validator


def _choice(value: Any, names: frozenset[str], tools_given: bool = True) -> tuple[ChoiceKind, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in _CHOICE_WORDS:
            raise bad_request(f"tool_choice: must be \"none\", \"auto\", \"required\" or a function, "
                              f"got {_quote(value)}", "invalid_value", "tool_choice")
        return value, None  # type: ignore[return-value]  # one of _CHOICE_WORDS
    if not isinstance(value, dict):
        raise _wrong_type("tool_choice", "a string or an object", value)
    return "named", _named_choice(value, names, tools_given)


def _named_choice(value: dict[str, Any], names: frozenset[str], tools_given: bool) -> str:
    _refuse_unknown_keys(value, _CHOICE_KEYS, "tool_choice")
    if value.get("type") != "function":
        raise bad_request(f"tool_choice.type: must be \"function\", got {_quote(value.get('type'))}",
                          "invalid_value", "tool_choice.type")
    function = value.get("function")
    if not isinstance(function, dict):
        raise _wrong_type("tool_choice.function", "an object with a name", function)
    _refuse_unknown_keys(function, frozenset({"name"}), "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str):
        raise _wrong_type("tool_choice.function.name", "a string", name)
    if not tools_given:
        raise bad_request("tool_choice: a named function needs tools", "invalid_value", "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice.function.name: {_quote(name)} is not the name of a tool in tools",
                          "invalid_value", "tool_choice.function.name")
    return name


def _refuse_unknown_keys(obj: dict[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(str(key) for key in obj if key not in known)
    if unknown:
        raise bad_request(f"{where}.{unknown[0][:_QUOTE_CHARS]}: unknown field; known: {', '.join(sorted(known))}",
                          "invalid_value", f"{where}.{unknown[0][:_QUOTE_CHARS]}")


def _missing(where: str) -> GatewayError:
    return bad_request(f"{where}: required", "missing_required_parameter", where)


def _wrong_type(where: str, what: str, value: Any) -> GatewayError:
    return bad_request(f"{where}: must be {what}, got {_json_type(value)}", "invalid_type", where)


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _quote(value: Any) -> str:
    """A client's value for an error message, cut short."""
    text = json.dumps(value) if isinstance(value, str | int | float | bool) or value is None else _json_type(value)
    return text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "..."
