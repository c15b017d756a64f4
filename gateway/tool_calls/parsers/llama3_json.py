"""Llama 3.1 / 3.2 / 3.3 JSON calls: the whole output is the call, a JSON
object, after an optional `<|python_tag|>` (present when the server keeps
special tokens), several calls separated by ";":

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

("arguments" is taken for "parameters" too.) An output that does not start
with a call (after whitespace) is content, all of it.

Malformed output never fails the request:
- a call that breaks before it is one (invalid JSON, a JSON answer without
  a name, a name that is no tool) is content, as written, and so is the
  rest of the output;
- a call that breaks after it started streaming keeps the arguments read so
  far, and the rest of the output is dropped;
- text after a call that is not ";" and another call is content.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from gateway.tool_calls.call_stream import CallInProgress
from gateway.tool_calls.calls import new_call_id
from gateway.tool_calls.parser_base import ToolCallParser
from gateway.tool_calls.parsers.registry import register

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class _State(Enum):
    START = "before the first call"
    CALL = "in a call"
    AFTER_CALL = "after a call"
    SEPARATED = "after a call and its separator"
    CONTENT = "content"
    IGNORE = "rest of the output"


@register("llama3_json")
class Llama3JsonParser(ToolCallParser):
    """`{"name": ..., "parameters": {...}}` calls, ";"-separated, from the output's start."""

    def __init__(self, tool_names: frozenset[str], parallel: bool = True,
                 make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tool_names, parallel, make_id)
        self._state = _State.START
        self._space: list[str] = []  # START: leading whitespace
        self._tag = ""  # START: what may be the python tag
        self._call: CallInProgress | None = None

    def _step(self, ch: str) -> None:
        if self._state is _State.START:
            self._start(ch)
        elif self._state is _State.CALL:
            self._in_call(ch)
        elif self._state is _State.AFTER_CALL:
            self._after_call(ch)
        elif self._state is _State.SEPARATED:
            self._separated(ch)
        elif self._state is _State.CONTENT:
            self._out.content(ch)

    def _start(self, ch: str) -> None:
        if not self._tag and ch.isspace():
            self._space.append(ch)
        elif PYTHON_TAG.startswith(self._tag + ch):
            self._tag += ch
            if self._tag == PYTHON_TAG:
                self._start_call(self._held())
        elif ch == "{" and not self._tag:
            self._start_call(self._held())
            self._in_call(ch)
        else:
            self._out.content(self._held() + ch)
            self._state = _State.CONTENT

    def _held(self) -> str:
        return "".join(self._space) + self._tag

    def _start_call(self, opening: str) -> None:
        self._call = CallInProgress(self._tool_names, self._out, opening)
        self._state = _State.CALL

    def _in_call(self, ch: str) -> None:
        call = self._call
        assert call is not None
        if call.feed(ch):
            if call.done:
                self._call = None
                self._state = _State.AFTER_CALL if self._may_call_again else _State.IGNORE
            return
        self._call = None
        if call.committed:
            self._state = _State.IGNORE
        else:
            self._out.content(call.held_text())
            self._state = _State.CONTENT
            self._out.content(ch)

    def _after_call(self, ch: str) -> None:
        if ch.isspace():
            return  # whitespace touching a call is dropped
        if ch == SEPARATOR:
            self._state = _State.SEPARATED  # the separator is dropped too
        else:
            self._state = _State.CONTENT
            self._out.content(ch)

    def _separated(self, ch: str) -> None:
        if ch.isspace():
            return
        if ch == "{":
            self._start_call("")
            self._in_call(ch)
        else:
            self._state = _State.CONTENT
            self._out.content(ch)

    def _end(self) -> None:
        if self._state is _State.START:
            self._out.content(self._held())
        elif self._state is _State.CALL:
            assert self._call is not None
            if not self._call.committed:
                self._out.content(self._call.held_text())
