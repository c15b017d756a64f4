"""Hermes-style calls (Hermes 2 Pro, Qwen2.5, Qwen3): each call is a JSON
object between tags, after any text the model writes first:

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content; whitespace touching a call (before its
tag, after it) is dropped. The closing tag is optional (an output cut at
the object's end, or the next `<tool_call>` right after it).

Malformed output never fails the request:
- a block that breaks before it is a call (invalid JSON, no name, a name
  that is no tool, arguments that are not an object) is content, as written;
- a call that breaks after it started streaming keeps the arguments read so
  far, and the rest of its block (up to `</tool_call>` or the next
  `<tool_call>`) is dropped;
- an output that ends inside a call's arguments keeps them cut short (the
  finish reason then says "length").
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from gateway.tool_calls.call_stream import CallInProgress
from gateway.tool_calls.calls import new_call_id
from gateway.tool_calls.parser_base import ToolCallParser
from gateway.tool_calls.parsers.registry import register

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class _State(Enum):
    TEXT = "text"
    CALL = "in a call"
    AFTER_CALL = "after a call"
    SKIP = "rest of a broken call's block"
    IGNORE = "rest of the output"


@register("hermes")
class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

    def __init__(self, tool_names: frozenset[str], parallel: bool = True,
                 make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tool_names, parallel, make_id)
        self._state = _State.TEXT
        self._space: list[str] = []  # whitespace held: dropped if a tag follows
        self._partial = ""  # what may be the start of a tag
        self._call: CallInProgress | None = None
        self._close_expected = False  # right after a call, before its closing tag

    def _step(self, ch: str) -> None:
        if self._state is _State.TEXT:
            self._text(ch)
        elif self._state is _State.CALL:
            self._in_call(ch)
        elif self._state is _State.AFTER_CALL:
            self._after_call(ch)
        elif self._state is _State.SKIP:
            self._skip(ch)

    def _text(self, ch: str) -> None:
        if self._partial or ch == "<":
            candidate = self._partial + ch
            if OPEN_TAG.startswith(candidate):
                self._partial = ""
                if candidate == OPEN_TAG:
                    self._start_call()
                else:
                    self._partial = candidate
                return
            # Not the tag after all: what was held is text; `ch` may start a tag itself.
            self._release(self._partial)
            self._partial = ""
            if ch == "<":
                self._partial = ch
                return
        if ch.isspace():
            self._space.append(ch)
        else:
            self._release(ch)

    def _release(self, text: str) -> None:
        """Content: the whitespace held, then `text`."""
        self._out.content("".join(self._space) + text)
        self._space.clear()

    def _start_call(self) -> None:
        # The whitespace goes with the tag: dropped if this is a call, kept if not.
        opening = "".join(self._space) + OPEN_TAG
        self._space.clear()
        self._call = CallInProgress(self._tool_names, self._out, opening)
        self._state = _State.CALL

    def _in_call(self, ch: str) -> None:
        call = self._call
        assert call is not None
        if call.feed(ch):
            if call.done:
                self._call, self._close_expected = None, True
                self._state = _State.AFTER_CALL if self._may_call_again else _State.IGNORE
            return
        self._call = None
        if call.committed:
            self._state = _State.SKIP if self._may_call_again else _State.IGNORE
            self._skip(ch)
        else:
            self._out.content(call.held_text())
            self._state = _State.TEXT
            self._text(ch)

    def _after_call(self, ch: str) -> None:
        if not self._partial and ch.isspace():
            return
        if self._close_expected:
            candidate = self._partial + ch
            if CLOSE_TAG.startswith(candidate):
                self._partial = candidate if candidate != CLOSE_TAG else ""
                self._close_expected = candidate != CLOSE_TAG
                return
            held, self._partial = candidate, ""
        else:
            held = ch
        # Text after the call (or the next call's tag): read as text from its start.
        self._close_expected = False
        self._state = _State.TEXT
        for c in held:
            self._text(c)

    def _skip(self, ch: str) -> None:
        """Drop text until the block's closing tag or the next call's opening one."""
        candidate = self._partial + ch
        if candidate == OPEN_TAG:
            self._partial = ""
            self._start_call()
        elif candidate == CLOSE_TAG:
            self._partial, self._close_expected = "", False
            self._state = _State.AFTER_CALL
        else:
            self._partial = _longest_tag_start(candidate)

    def _end(self) -> None:
        if self._state is _State.TEXT:
            self._release(self._partial)
        elif self._state is _State.CALL:
            assert self._call is not None
            if not self._call.committed:
                self._out.content(self._call.held_text())
        # After a call: a cut closing tag is the call's; skipped text is dropped.
        self._partial = ""
        self._space.clear()


def _longest_tag_start(text: str) -> str:
    """The longest end of `text` that may begin either tag."""
    for start in range(max(0, len(text) - len(CLOSE_TAG)), len(text)):
        tail = text[start:]
        if OPEN_TAG.startswith(tail) or CLOSE_TAG.startswith(tail):
            return tail
    return ""
