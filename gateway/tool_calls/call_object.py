"""One call object as models write it, `{"name": "f", "arguments": {...}}`
(Llama 3 says "parameters"), read a character at a time: the name once its
string closes, and the arguments object's text as it arrives.

Strict: the object must be valid JSON, with a name, a string naming one of
the request's tools, the arguments (when given) an object, neither given twice.
Other members are skipped (some models add "type" or "id"). The first
character that breaks a rule fails the object (`feed` returns False); what
then becomes of the text is the parser's choice.
"""

from __future__ import annotations

import json

from gateway.tool_calls.json_scan import WHITESPACE, JsonScanner, Mode
from gateway.tool_calls.limits import MAX_TOOL_NAME_CHARS

ARGUMENT_KEYS = frozenset({"arguments", "parameters"})
# A tool name's JSON string: 64 characters, each at most a 6-character \u escape, and the quotes.
_MAX_NAME_RAW = 6 * MAX_TOOL_NAME_CHARS + 2
# Longer keys are none of ours: only their end matters.
_MAX_KEY_RAW = 64


class CallObject:
    """Reads one call object. `name` is set once its string closed and names a
    tool; `arguments` holds the arguments object's characters read so far,
    from its "{" (`arguments_started`) to its "}" (`arguments_done`); `done`
    once the whole object closed; `failed` once a character broke it."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.name: str | None = None
        self.arguments: list[str] = []
        self.arguments_started = False
        self.arguments_done = False
        self.failed = False
        self._json = JsonScanner()
        self._tool_names = tool_names
        self._member: str | None = None  # the key of the top-level member being read
        self._seen: set[str] = set()
        self._key_raw: list[str] | None = None
        self._key_too_long = False
        self._name_raw: list[str] | None = None
        self._in_arguments = False

    @property
    def done(self) -> bool:
        return self._json.done

    def feed(self, ch: str) -> bool:
        """Take one character; False when it breaks the object (for good)."""
        if self.failed or not self._take(ch):
            self.failed = True
            return False
        return True

    def _take(self, ch: str) -> bool:
        scanner = self._json
        depth, mode = scanner.depth, scanner.mode
        if depth == 0 and mode is Mode.VALUE and ch not in WHITESPACE and ch != "{":
            return False
        if not scanner.feed(ch):
            return False
        if scanner.done and self.name is None:
            return False  # an object without a name is no call
        if self._in_arguments:
            self.arguments.append(ch)
            if scanner.depth == 1:
                self._in_arguments, self.arguments_done = False, True
            return True
        if depth != 1:
            return True  # the opening "{", or inside a member this reader skips
        if mode in (Mode.FIRST_KEY_OR_CLOSE, Mode.KEY) and ch == '"':
            self._key_raw, self._key_too_long = [ch], False
            return True
        if self._key_raw is not None:
            return self._key_char(ch)
        if self._name_raw is not None:
            return self._name_char(ch)
        if mode is Mode.VALUE and ch not in WHITESPACE:
            return self._member_value_start(ch)
        return True

    def _key_char(self, ch: str) -> bool:
        assert self._key_raw is not None
        if len(self._key_raw) < _MAX_KEY_RAW:
            self._key_raw.append(ch)
        else:
            self._key_too_long = True
        if self._json.mode is not Mode.COLON:
            return True
        # The key's closing quote.
        key = None if self._key_too_long else json.loads("".join(self._key_raw))
        self._key_raw = None
        member = "arguments" if key in ARGUMENT_KEYS else key
        if member in ("name", "arguments"):
            if member in self._seen:
                return False  # given twice: which one would the model mean?
            self._seen.add(member)
        self._member = member
        return True

    def _member_value_start(self, ch: str) -> bool:
        if self._member == "name":
            if ch != '"':
                return False
            self._name_raw = [ch]
        elif self._member == "arguments":
            if ch != "{":
                return False
            self.arguments_started = self._in_arguments = True
            self.arguments.append(ch)
        return True

    def _name_char(self, ch: str) -> bool:
        assert self._name_raw is not None
        self._name_raw.append(ch)
        if len(self._name_raw) > _MAX_NAME_RAW:
            return False
        if self._json.in_string:
            return True
        name = json.loads("".join(self._name_raw))
        self._name_raw = None
        if name not in self._tool_names:
            return False
        self.name = name
        return True
