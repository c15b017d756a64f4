"""The conversation's earlier tool calls and their results, as chat
templates take them (transformers' convention, which vLLM follows): an
assistant message's `tool_calls` with each call's `function.arguments`
parsed from OpenAI's JSON text to an object (templates write it with
`tojson` or walk its items), a tool message's `tool_call_id`.

Where a call or a result may appear, and the bounds of what they carry,
are checked here, each mistake a 400 naming the field
(``messages[3].tool_calls[0].function.arguments``); the front ends have
checked the types (REST's document states the same bounds).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from gateway.tool_calls.limits import (
    MAX_MESSAGE_TOOL_CALLS,
    MAX_TOOL_CALL_ARGUMENTS_CHARS,
    MAX_TOOL_CALL_ID_CHARS,
    TOOL_NAME_RULE,
)


@dataclass(frozen=True)
class HistoryCall:
    """A call an earlier assistant message made, as the client sends it back."""

    id: str
    name: str
    arguments: str
    """The arguments object's JSON text, as OpenAI's `function.arguments`."""


def template_message(where: str, role: str, content: str, tool_calls: Sequence[HistoryCall] = (),
                     tool_call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    """One message for the chat template; `where` names it in errors
    ("messages[3]"). `content` is its text ("" for none: a message that
    only calls tools has none, and simple templates concatenate it)."""
    _check_placement(where, role, len(tool_calls), tool_call_id)
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        message["tool_calls"] = [_template_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(tool_calls)]
    if role == "tool":
        message["tool_call_id"] = tool_call_id
        if name is not None:
            message["name"] = name  # the function's name: some templates write it
    return message


def _check_placement(where: str, role: str, num_calls: int, tool_call_id: str | None) -> None:
    """Calls only on an assistant message, a call id on a tool message (always)."""
    if num_calls and role != "assistant":
        raise bad_request(f"{where}.tool_calls: only an assistant message carries tool calls", "invalid_value",
                          f"{where}.tool_calls")
    if tool_call_id is not None and role != "tool":
        raise bad_request(f"{where}.tool_call_id: only a tool message answers a tool call", "invalid_value",
                          f"{where}.tool_call_id")
    if role == "tool" and not tool_call_id:
        raise bad_request(f"{where}.tool_call_id: required on a tool message (the id of the call it answers)",
                          "missing_required_parameter", f"{where}.tool_call_id")
    if tool_call_id is not None:
        _check_id(tool_call_id, f"{where}.tool_call_id")
    if num_calls > MAX_MESSAGE_TOOL_CALLS:
        raise bad_request(f"{where}.tool_calls: {num_calls} calls, at most {MAX_MESSAGE_TOOL_CALLS} are allowed",
                          "invalid_value", f"{where}.tool_calls")


def _check_id(call_id: str, where: str) -> None:
    if not 0 < len(call_id) <= MAX_TOOL_CALL_ID_CHARS:
        raise bad_request(f"{where}: must be 1 to {MAX_TOOL_CALL_ID_CHARS} characters", "invalid_value", where)


def _template_call(call: HistoryCall, where: str) -> dict[str, Any]:
    _check_id(call.id, f"{where}.id")
    if not TOOL_NAME_RULE.fullmatch(call.name):
        raise bad_request(f"{where}.function.name: must be 1 to 64 letters, digits, underscores or dashes",
                          "invalid_value", f"{where}.function.name")
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": _arguments(call, where)}}


def _arguments(call: HistoryCall, where: str) -> dict[str, Any]:
    where = f"{where}.function.arguments"
    if len(call.arguments) > MAX_TOOL_CALL_ARGUMENTS_CHARS:
        raise bad_request(f"{where}: longer than {MAX_TOOL_CALL_ARGUMENTS_CHARS} characters", "invalid_value", where)
    try:
        arguments = json.loads(call.arguments)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        arguments = None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}: must be the JSON text of an object (the chat template writes it as one)",
                          "invalid_value", where)
    return arguments
