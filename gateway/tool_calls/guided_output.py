"""Parsers of the output guided decoding makes for tool_choice "required"
and a named function (gateway/tool_calls/guided.py): the grammar shapes the
output, these turn it into calls and stream it as they do.

Under guided decoding the output is the JSON and nothing else: none of it
is content. What the grammar rules out can only come from an output cut
short (max_tokens): the calls read so far are kept (the last one's
arguments cut short, the finish reason "length"), the rest is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from gateway.tool_calls.call_stream import CallInProgress
from gateway.tool_calls.calls import new_call_id
from gateway.tool_calls.json_scan import WHITESPACE, JsonScanner
from gateway.tool_calls.parser_base import ToolCallParser


class NamedCallParser(ToolCallParser):
    """tool_choice names a function: the output is its arguments object.
    The call opens with the object's "{", each character then streams."""

    def __init__(self, name: str, make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(frozenset({name}), parallel=False, make_id=make_id)
        self._name = name
        self._json: JsonScanner | None = None
        self._over = False  # the object closed, or the output broke it

    def _step(self, ch: str) -> None:
        if self._over:
            return
        if self._json is None:
            if ch in WHITESPACE:
                return
            if ch != "{":
                self._over = True
                return
            self._json = JsonScanner()
            self._out.open_call(self._name)
        if not self._json.feed(ch):
            self._over = True
            return
        self._out.arguments(ch)
        self._over = self._json.done

    def _end(self) -> None:
        pass


class _Array(Enum):
    OPEN = "before ["
    FIRST = "before the first call or ]"
    CALL = "in a call"
    AFTER_CALL = "before , or ]"
    NEXT = "before the next call"
    OVER = "after ], or broken"


class RequiredCallsParser(ToolCallParser):
    """tool_choice "required": the output is a JSON array of call objects,
    `[{"name": ..., "arguments": {...}}, ...]`."""

    def __init__(self, tool_names: frozenset[str], parallel: bool = True,
                 make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tool_names, parallel, make_id)
        self._state = _Array.OPEN
        self._call: CallInProgress | None = None

    def _step(self, ch: str) -> None:
        state = self._state
        if state is _Array.CALL:
            self._in_call(ch)
        elif state is _Array.OVER or ch in WHITESPACE:
            return
        elif state is _Array.OPEN:
            self._state = _Array.FIRST if ch == "[" else _Array.OVER
        elif ch == "{" and state in (_Array.FIRST, _Array.NEXT):
            self._call = CallInProgress(self._tool_names, self._out)
            self._state = _Array.CALL
            self._in_call(ch)
        elif ch == "," and state is _Array.AFTER_CALL:
            self._state = _Array.NEXT
        else:  # "]", or anything the grammar rules out
            self._state = _Array.OVER

    def _in_call(self, ch: str) -> None:
        assert self._call is not None
        if not self._call.feed(ch):
            self._state = _Array.OVER
        elif self._call.done:
            self._state = _Array.AFTER_CALL if self._may_call_again else _Array.OVER

    def _end(self) -> None:
        pass
