"""What parsing a model's output yields: tool calls and content for a whole
output, OpenAI's delta shape for a stream, and the finish reason."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any

# OpenAI's ids look like call_ and 24 letters and digits.
_ID_ALPHABET = string.ascii_letters + string.digits
_ID_CHARS = 24


def new_call_id() -> str:
    """A fresh tool-call id, as OpenAI's look: "call_" and 24 letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_CHARS))


@dataclass(frozen=True)
class ToolCall:
    """One call the model made."""

    id: str
    """Unique to the call ("call_..."); the client answers with it in a tool message."""
    name: str
    """The function's name, one of the request's tools."""
    arguments_json: str
    """The arguments object's JSON text exactly as the model wrote it, from its
    "{" to its matching "}" (only cut short when the output was: see
    docs/tool-calling.md); "{}" when the model gave none."""

    def to_openai(self) -> dict[str, Any]:
        """The call in `message.tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output, split into content and calls."""

    content: str | None
    """The text that is not a tool call; None when there is none."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls, in the order the model made them."""

    def to_openai_message(self) -> dict[str, Any]:
        """The assistant `message` of a chat completion's choice."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one call in a stream: first its id and name (once, with empty
    arguments), then fragments of its arguments, in order."""

    index: int
    """The call's position among the output's calls (0, 1, ...)."""
    id: str | None = None
    """Set on the call's first delta only."""
    name: str | None = None
    """Set on the call's first delta only."""
    arguments: str = ""
    """The next fragment of the arguments JSON ("" on the first delta)."""

    def to_openai(self) -> dict[str, Any]:
        """An entry of a chunk's `delta.tool_calls`."""
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass(frozen=True)
class StreamDelta:
    """What one piece of output adds to a stream: falsy when nothing (the text
    is held until it can be told apart from a call's start)."""

    content: str = ""
    """Content text to send."""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    """Pieces of calls to send, in order."""

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def to_openai(self) -> dict[str, Any]:
        """A chunk's `delta` (without the role, which the first chunk adds)."""
        delta: dict[str, Any] = {}
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return delta


def finish_reason(engine_reason: str, output: ParsedOutput) -> str:
    """A choice's finish reason: "tool_calls" when the model stopped after
    making calls; the engine's own otherwise ("length" stays "length": the
    last call's arguments may then be cut short)."""
    if output.tool_calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason
