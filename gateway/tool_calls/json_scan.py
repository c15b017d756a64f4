"""Strict JSON (RFC 8259) checked one character at a time, as a model writes
it: every character the scanner accepts keeps the text a prefix of some
valid JSON value, so the first character that breaks it is known at once,
whatever the pieces the text arrives in.

The parsers use it to know where a call's arguments object ends without
waiting for the rest of the output, and to stream only text that can still
be valid JSON.
"""

from __future__ import annotations

from enum import Enum

from gateway.tool_calls.limits import MAX_OUTPUT_JSON_DEPTH

WHITESPACE = frozenset(" \t\n\r")
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class Mode(Enum):
    """What the scanner expects next."""

    VALUE = "value"
    FIRST_KEY_OR_CLOSE = "first key or }"
    KEY = "key"
    COLON = "colon"
    FIRST_VALUE_OR_CLOSE = "first value or ]"
    AFTER_VALUE = ", or a closing bracket"
    STRING = "string"
    ESCAPE = "escape"
    UNICODE = "unicode escape"
    NUMBER = "number"
    LITERAL = "literal"
    DONE = "done"


STRING_MODES = frozenset({Mode.STRING, Mode.ESCAPE, Mode.UNICODE})


class _Number(Enum):
    """Where in a number (RFC 8259's grammar) the scanner is."""

    MINUS = "after -"
    ZERO = "leading 0"
    INT = "integer digits"
    DOT = "after ."
    FRACTION = "fraction digits"
    E = "after e"
    E_SIGN = "after the exponent's sign"
    EXPONENT = "exponent digits"


_NUMBER_CAN_END = frozenset({_Number.ZERO, _Number.INT, _Number.FRACTION, _Number.EXPONENT})


class JsonScanner:
    """Checks one JSON value, a character at a time (`feed`). `depth` is how
    many objects and arrays are open; `mode` what comes next; `done` once the
    value is complete (a top-level number is complete only when the character
    after it arrives, which is then refused: the parsers read objects)."""

    def __init__(self, max_depth: int = MAX_OUTPUT_JSON_DEPTH) -> None:
        self.mode = Mode.VALUE
        self._stack: list[str] = []  # "{" or "[" per open container
        self._max_depth = max_depth
        self._string_is_key = False
        self._literal_rest = ""
        self._hex_left = 0
        self._number = _Number.INT

    @property
    def depth(self) -> int:
        return len(self._stack)

    @property
    def done(self) -> bool:
        return self.mode is Mode.DONE

    @property
    def in_string(self) -> bool:
        return self.mode in STRING_MODES

    def feed(self, ch: str) -> bool:
        """Take one character; False when it cannot continue valid JSON (the
        scanner is then of no further use)."""
        mode = self.mode
        if mode is Mode.STRING:
            return self._string(ch)
        if mode is Mode.NUMBER:
            return self._number_char(ch)
        if mode in (Mode.ESCAPE, Mode.UNICODE):
            return self._escape(ch)
        if mode is Mode.LITERAL:
            return self._literal(ch)
        if ch in WHITESPACE:
            return mode is not Mode.DONE
        return self._structural(ch)

    def _structural(self, ch: str) -> bool:
        mode = self.mode
        if mode in (Mode.VALUE, Mode.FIRST_VALUE_OR_CLOSE):
            if mode is Mode.FIRST_VALUE_OR_CLOSE and ch == "]":
                return self._close()
            return self._value_start(ch)
        if mode in (Mode.FIRST_KEY_OR_CLOSE, Mode.KEY):
            if mode is Mode.FIRST_KEY_OR_CLOSE and ch == "}":
                return self._close()
            if ch != '"':
                return False
            self.mode, self._string_is_key = Mode.STRING, True
            return True
        if mode is Mode.COLON:
            if ch != ":":
                return False
            self.mode = Mode.VALUE
            return True
        if mode is Mode.AFTER_VALUE:
            return self._after_value(ch)
        return False  # DONE

    def _value_start(self, ch: str) -> bool:
        if ch in "{[":
            if len(self._stack) >= self._max_depth:
                return False
            self._stack.append(ch)
            self.mode = Mode.FIRST_KEY_OR_CLOSE if ch == "{" else Mode.FIRST_VALUE_OR_CLOSE
        elif ch == '"':
            self.mode, self._string_is_key = Mode.STRING, False
        elif ch == "-" or ch in _DIGITS:
            self.mode = Mode.NUMBER
            self._number = _Number.MINUS if ch == "-" else _Number.ZERO if ch == "0" else _Number.INT
        elif ch in _LITERALS:
            self.mode, self._literal_rest = Mode.LITERAL, _LITERALS[ch]
        else:
            return False
        return True

    def _after_value(self, ch: str) -> bool:
        top = self._stack[-1]
        if ch == ",":
            self.mode = Mode.KEY if top == "{" else Mode.VALUE
            return True
        if (ch == "}" and top == "{") or (ch == "]" and top == "["):
            return self._close()
        return False

    def _close(self) -> bool:
        self._stack.pop()
        self._value_ended()
        return True

    def _value_ended(self) -> None:
        self.mode = Mode.AFTER_VALUE if self._stack else Mode.DONE

    def _string(self, ch: str) -> bool:
        if ch == '"':
            if self._string_is_key:
                self.mode = Mode.COLON
            else:
                self._value_ended()
        elif ch == "\\":
            self.mode = Mode.ESCAPE
        elif ch < " ":  # control characters must be escaped
            return False
        return True

    def _escape(self, ch: str) -> bool:
        if self.mode is Mode.ESCAPE:
            if ch == "u":
                self.mode, self._hex_left = Mode.UNICODE, 4
                return True
            if ch not in _SIMPLE_ESCAPES:
                return False
            self.mode = Mode.STRING
            return True
        if ch not in _HEX:
            return False
        self._hex_left -= 1
        if self._hex_left == 0:
            self.mode = Mode.STRING
        return True

    def _literal(self, ch: str) -> bool:
        if ch != self._literal_rest[0]:
            return False
        self._literal_rest = self._literal_rest[1:]
        if not self._literal_rest:
            self._value_ended()
        return True

    def _number_char(self, ch: str) -> bool:
        step = _next_number_state(self._number, ch)
        if step is not None:
            self._number = step
            return True
        if self._number not in _NUMBER_CAN_END:
            return False
        # The number ended just before `ch`, which belongs to what follows.
        self._value_ended()
        if self.done:
            return False
        return self.feed(ch)


def _next_number_state(state: _Number, ch: str) -> _Number | None:
    """The number's state after `ch`, or None when `ch` is not part of it."""
    digit = ch in _DIGITS
    if state is _Number.MINUS:
        return (_Number.ZERO if ch == "0" else _Number.INT) if digit else None
    if state in (_Number.ZERO, _Number.INT):
        if digit and state is _Number.INT:
            return _Number.INT
        return _Number.DOT if ch == "." else _Number.E if ch in "eE" else None
    if state in (_Number.DOT, _Number.FRACTION):
        if digit:
            return _Number.FRACTION
        return _Number.E if ch in "eE" and state is _Number.FRACTION else None
    if state is _Number.E:
        return _Number.EXPONENT if digit else _Number.E_SIGN if ch in "+-" else None
    return _Number.EXPONENT if digit else None  # E_SIGN, EXPONENT
