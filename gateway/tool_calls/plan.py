"""The one call the request path makes: a chat request's tool fields in, what
to do with them out (the tools for the chat template, the guided-decoding
constraint, a parser for each choice's output), every refusal a 400 before
any engine time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from gateway.tool_calls.calls import new_call_id
from gateway.tool_calls.definitions import ToolRequest, parse_tool_request
from gateway.tool_calls.guided import guided_constraint, guided_parser
from gateway.tool_calls.parser_base import ToolCallParser
from gateway.tool_calls.parsers import parser_class
from tessera.structured_output import StructuredOutputsParams


@dataclass(frozen=True)
class ToolCallPlan:
    """How one chat request uses tools."""

    request: ToolRequest
    """The checked tools, tool_choice and parallel_tool_calls."""
    constraint: StructuredOutputsParams | None
    """The guided-decoding constraint ("required", named), else None; the
    request may then carry no other output constraint."""
    parser_name: str | None
    """The auto parser's registered name ("auto"), else None."""

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (its `tools=`), also with "none":
        the model knows them, it is only not to call them."""
        return self.request.template_tools()

    def new_parser(self, make_id: Callable[[], str] = new_call_id) -> ToolCallParser | None:
        """A fresh parser for one choice's output; None with "none" (the
        output is content, as without tools)."""
        if self.request.choice == "none":
            return None
        if self.constraint is not None:
            return guided_parser(self.request, make_id)
        assert self.parser_name is not None
        return parser_class(self.parser_name)(self.request.names, parallel=self.request.parallel, make_id=make_id)


def new_choice_parser(plan: ToolCallPlan | None) -> ToolCallParser | None:
    """A fresh parser for one choice of a request planned as `plan` (None:
    the request has no tools); None when the output is content, as without tools."""
    return plan.new_parser() if plan is not None else None


def plan_tool_calls(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None,
                    parser_name: str | None = None) -> ToolCallPlan | None:
    """The plan for a chat request's raw `tools`, `tool_choice` and
    `parallel_tool_calls` (None where absent), with the model's configured
    auto parser (None: none configured); None when the request uses no
    tools. Raises a 400 GatewayError naming the field at fault, and for
    "auto" (the default with tools) when the model has no parser: its
    calls could not be found in its text."""
    request = parse_tool_request(tools, tool_choice, parallel_tool_calls)
    if request is None:
        return None
    constraint = guided_constraint(request)
    if request.choice != "auto":
        return ToolCallPlan(request, constraint, None)
    if parser_name is None:
        raise bad_request("tool_choice: \"auto\" needs a tool-call parser, and none is configured for this model; "
                          "use \"required\", a named function or \"none\"", "invalid_value", "tool_choice")
    parser_class(parser_name)  # a configuration mistake is a ValueError, not the client's 400
    return ToolCallPlan(request, constraint, parser_name)
