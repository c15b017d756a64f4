"""Shared by the tool-call tests: tools, deterministic ids, and the
reassembly of a stream as a client (the OpenAI SDK) does it, from the wire
shape."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable

from gateway.tool_calls import ParsedOutput, StreamDelta, ToolCall, ToolCallParser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                       "required": ["query"]},
    },
}
NO_ARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, SEARCH, NO_ARGS]
NAMES = frozenset({"get_weather", "search", "now"})


def counting_ids() -> Callable[[], str]:
    """Ids call_0, call_1, ...: two parsers given fresh ones name their calls alike."""
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def stream(parser: ToolCallParser, pieces: Iterable[str]) -> list[StreamDelta]:
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    return [d for d in deltas if d]


def reassemble(deltas: list[StreamDelta]) -> ParsedOutput:
    """What a client rebuilds from the chunks' `delta` objects, checking the
    shape on the way: each call's first delta has its id, type and name with
    empty arguments, its index the next one; fragments only for the newest
    call."""
    content: list[str] = []
    calls: list[list] = []
    for delta in deltas:
        wire = delta.to_openai()
        assert wire, "an empty delta was sent"
        content.append(wire.get("content", ""))
        for piece in wire.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] == len(calls)
                assert piece["type"] == "function" and piece["function"]["arguments"] == ""
                calls.append([piece["id"], piece["function"]["name"], []])
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
                assert piece["index"] == len(calls) - 1, "a fragment for another call than the newest"
                assert piece["function"]["arguments"], "an empty fragment"
                calls[-1][2].append(piece["function"]["arguments"])
    text = "".join(content)
    return ParsedOutput(text or None, tuple(ToolCall(i, n, "".join(a)) for i, n, a in calls))


def two_piece_splits(text: str) -> Iterable[list[str]]:
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]


def random_splits(text: str, seed: int, count: int) -> Iterable[list[str]]:
    rng = random.Random(seed)
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]
