"""What every tool-call parser is: fed a model's output a piece at a time,
it hands back each piece's stream delta, and at the end the whole output's
content and calls.

A parser is one state machine read a character at a time, for streaming
and non-streaming alike (`parse` feeds the whole text at once), and what it
finds reaches both through one OutputAssembler: the deltas of a stream
reassemble to the non-streaming result whatever the pieces, which the tests
check at every split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from gateway.tool_calls.assembly import OutputAssembler
from gateway.tool_calls.calls import ParsedOutput, StreamDelta, new_call_id


class ToolCallParser(ABC):
    """One choice's output. Use once: `feed` each text delta, then `finish`
    (both return what to stream); `result` gives the whole; or `parse` a
    whole output in one call."""

    def __init__(self, tool_names: frozenset[str], parallel: bool = True,
                 make_id: Callable[[], str] = new_call_id) -> None:
        self._tool_names = tool_names
        self._parallel = parallel
        self._out = OutputAssembler(make_id)
        self._finished = False

    def feed(self, text: str) -> StreamDelta:
        """The next piece of output; what of it can be streamed now (text that
        may still turn out to start a call is held back)."""
        if self._finished:
            raise RuntimeError("the output already finished")
        for ch in text:
            self._step(ch)
        return self._out.take_delta()

    def finish(self) -> StreamDelta:
        """The output ended: what was held back, settled."""
        if not self._finished:
            self._finished = True
            self._end()
        return self._out.take_delta()

    def result(self) -> ParsedOutput:
        """Content and calls so far (the whole output's once finished)."""
        return self._out.result()

    def parse(self, text: str) -> ParsedOutput:
        """A whole output at once (non-streaming)."""
        self.feed(text)
        self.finish()
        return self.result()

    @property
    def _may_call_again(self) -> bool:
        """parallel_tool_calls false: one call, then the rest of the output is dropped."""
        return self._parallel or self._out.call_count == 0

    @abstractmethod
    def _step(self, ch: str) -> None:
        """One character of output."""

    @abstractmethod
    def _end(self) -> None:
        """The output ended: settle what is held."""
