"""One place where a parser's findings become both the stream's deltas and
the whole output's result: whatever a parser reports goes to both, so a
stream always reassembles to the non-streaming answer."""

from __future__ import annotations

from collections.abc import Callable

from gateway.tool_calls.calls import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta


class _CallBuilder:
    __slots__ = ("id", "name", "arguments")

    def __init__(self, call_id: str, name: str) -> None:
        self.id = call_id
        self.name = name
        self.arguments: list[str] = []


class _PendingDelta:
    """A ToolCallDelta being built: fragments are joined once, when taken
    (joining them one by one would be quadratic in a long output)."""

    __slots__ = ("index", "id", "name", "fragments")

    def __init__(self, index: int, call_id: str | None = None, name: str | None = None) -> None:
        self.index = index
        self.id = call_id
        self.name = name
        self.fragments: list[str] = []

    def build(self) -> ToolCallDelta:
        return ToolCallDelta(self.index, self.id, self.name, "".join(self.fragments))


class OutputAssembler:
    """Collects content text and calls; `take_delta` hands out what was
    added since the last take, `result` the whole so far."""

    def __init__(self, make_id: Callable[[], str]) -> None:
        self._make_id = make_id
        self._content: list[str] = []
        self._calls: list[_CallBuilder] = []
        self._delta_content: list[str] = []
        self._delta_calls: list[_PendingDelta] = []

    @property
    def call_count(self) -> int:
        """How many calls were opened."""
        return len(self._calls)

    def content(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._delta_content.append(text)

    def open_call(self, name: str) -> None:
        """A new call, with its id; its arguments follow."""
        call = _CallBuilder(self._make_id(), name)
        self._calls.append(call)
        self._delta_calls.append(_PendingDelta(len(self._calls) - 1, call.id, name))

    def arguments(self, fragment: str) -> None:
        """More of the last opened call's arguments."""
        if not fragment:
            return
        self._calls[-1].arguments.append(fragment)
        index = len(self._calls) - 1
        last = self._delta_calls[-1] if self._delta_calls else None
        # A call's first delta carries empty arguments; its fragments within
        # one delta after that go out as one piece.
        if last is None or last.index != index or last.id is not None:
            last = _PendingDelta(index)
            self._delta_calls.append(last)
        last.fragments.append(fragment)

    def take_delta(self) -> StreamDelta:
        delta = StreamDelta("".join(self._delta_content), tuple(d.build() for d in self._delta_calls))
        self._delta_content.clear()
        self._delta_calls.clear()
        return delta

    def result(self) -> ParsedOutput:
        content = "".join(self._content)
        calls = tuple(ToolCall(call.id, call.name, "".join(call.arguments)) for call in self._calls)
        return ParsedOutput(content or None, calls)
