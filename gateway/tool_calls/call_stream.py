"""One call object between the model's text and the output: held back until
it is certainly a call, then streamed.

A call is *committed* once its name names a tool and its arguments object
has begun (or the object closed without one): only then does it reach the
output (the id and name, then the arguments held so far), so text that only
looked like a call at first (a JSON answer, a name that is no tool) never
became a call and can still be content. Once committed, each character of
the arguments goes out as it is read.
"""

from __future__ import annotations

from gateway.tool_calls.assembly import OutputAssembler
from gateway.tool_calls.call_object import CallObject


class CallInProgress:
    """Feeds a CallObject and reports it to `out`. `opening` is the text
    that introduced the call (a tag), given back with the rest if the
    call fails before it is committed."""

    def __init__(self, tool_names: frozenset[str], out: OutputAssembler, opening: str = "") -> None:
        self._object = CallObject(tool_names)
        self._out = out
        self._held: list[str] | None = [opening]  # the text so far, until committed
        self._sent = 0  # arguments characters sent
        self.committed = False

    @property
    def done(self) -> bool:
        """The object closed: the call is complete."""
        return self._object.done

    def feed(self, ch: str) -> bool:
        """Take one character; False when it breaks the call (`ch` is then not taken)."""
        if not self._object.feed(ch):
            return False
        if self._held is not None:
            self._held.append(ch)
        self._report()
        return True

    def held_text(self) -> str:
        """The text of a call that was never committed (for the parser to give
        back as content); "" once committed."""
        return "".join(self._held) if self._held is not None else ""

    def _report(self) -> None:
        obj = self._object
        if not self.committed:
            if obj.name is None or not (obj.arguments_started or obj.done):
                return
            self.committed, self._held = True, None
            self._out.open_call(obj.name)
        if self._sent < len(obj.arguments):
            self._out.arguments("".join(obj.arguments[self._sent:]))
            self._sent = len(obj.arguments)
        elif obj.done and not obj.arguments_started:
            self._out.arguments("{}")  # no arguments: the empty object
