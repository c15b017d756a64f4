"""Tool calling for /v1/chat/completions (OpenAI's `tools`, `tool_choice`,
`parallel_tool_calls`): the pure parts, with no I/O and no engine. See
docs/tool-calling.md.

How the request path uses it::

    plan = plan_tool_calls(body.tools, body.tool_choice, body.parallel_tool_calls,
                           parser_name=model_config.tool_call_parser)   # 400 on any mistake
    if plan is not None:
        template_tools = plan.template_tools       # the chat template's tools=
        if plan.constraint is not None:            # "required" / named: guided decoding
            ...                                    # refuse another output constraint; use this one
    # per choice:
    parser = new_choice_parser(plan)               # None: the output is content, as today
    # streaming: for each text delta of the choice
    delta = parser.feed(text)                      # StreamDelta; send delta.to_openai() when truthy
    delta = parser.finish()                        # at the choice's end; send it, then
    reason = finish_reason(engine_reason, parser.result())
    # non-streaming:
    output = parser.parse(text)                    # ParsedOutput
    message = output.to_openai_message()           # {"role", "content", "tool_calls"?}
    reason = finish_reason(engine_reason, output)

Modules, each one job:
- limits: the bounds (tools, names, schema sizes, output nesting);
- definitions: the request's tool fields, checked (FunctionTool, ToolRequest);
- guided: the "required" and named-function constraints and their parsers' choice;
- guided_output: the parsers of guided output;
- parsers/: the "auto" parsers by configured name (hermes, llama3_json), a registry;
- plan: the one entry point above;
- calls: what a parse yields (ToolCall, ParsedOutput, ToolCallDelta, StreamDelta, finish_reason);
- parser_base, assembly, call_stream, call_object, json_scan: how the parsers read
  output a character at a time, so a stream reassembles to the whole output's result.
"""

from gateway.tool_calls.calls import (
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    finish_reason,
    new_call_id,
)
from gateway.tool_calls.definitions import FunctionTool, ToolRequest, parse_tool_request
from gateway.tool_calls.guided import guided_constraint, parse_guided_output
from gateway.tool_calls.parser_base import ToolCallParser
from gateway.tool_calls.parsers import parser_class, parser_names
from gateway.tool_calls.plan import ToolCallPlan, new_choice_parser, plan_tool_calls

__all__ = [
    "FunctionTool",
    "ParsedOutput",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallPlan",
    "ToolRequest",
    "finish_reason",
    "guided_constraint",
    "new_call_id",
    "new_choice_parser",
    "parse_guided_output",
    "parse_tool_request",
    "parser_class",
    "parser_names",
    "plan_tool_calls",
]
