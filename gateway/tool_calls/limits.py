"""Bounds on what a client sends with its tools and on what the parsers hold.

Every number here is a documented limit (docs/tool-calling.md): a request
past one is a 400 naming the field, never a slow request.
"""

from __future__ import annotations

import re

# OpenAI's own limit on the functions of one request.
MAX_TOOLS = 128
# OpenAI's rule for a function name: letters, digits, underscores and dashes, 1 to 64.
TOOL_NAME_RULE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOL_NAME_CHARS = 64
# A description goes into the prompt, where the context bounds it too; this
# bounds the work before the prompt is even rendered.
MAX_DESCRIPTION_CHARS = 8192
# One function's parameters schema, as compact JSON. Real schemas are a few KiB.
MAX_SCHEMA_BYTES = 64 * 1024
# All the request's schemas together: the `required` constraint embeds them
# all, and the grammar backend compiles it (gateway/constraint_check.py takes
# the same bound for a regex or a grammar).
MAX_TOTAL_SCHEMA_BYTES = 256 * 1024
# Nesting of a schema (objects and arrays), far above real schemas, well
# below Python's recursion limit for the meta-schema validator.
MAX_SCHEMA_DEPTH = 64
# Nesting of the JSON a model writes in a tool call: the parsers keep one
# stack entry per level; deeper output is malformed.
MAX_OUTPUT_JSON_DEPTH = 256
# The conversation's earlier calls a client sends back (an assistant message's
# `tool_calls`, a tool message's `tool_call_id`): ids are the client's or
# another server's, whose lengths vary (ours are 29 characters).
MAX_TOOL_CALL_ID_CHARS = 256
# Calls in one assistant message: far above what models make in one turn.
MAX_MESSAGE_TOOL_CALLS = MAX_TOOLS
# One call's arguments JSON text sent back: far above real arguments; the
# context bounds the rendered prompt after that.
MAX_TOOL_CALL_ARGUMENTS_CHARS = 1 << 20
