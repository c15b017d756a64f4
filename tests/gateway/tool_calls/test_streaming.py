"""Streaming: whatever the pieces an output arrives in (split at every
position, one character at a time, random splits), the deltas reassemble to
exactly the non-streaming result: the same content, the same calls with the
same ids and names, the same arguments; ids and names come first, then
argument fragments; nothing is lost or duplicated."""

from __future__ import annotations

import random

import pytest

from gateway.tool_calls import ParsedOutput, ToolCallParser, parse_tool_request, parser_class
from gateway.tool_calls.guided import guided_parser
from tests.gateway.tool_calls.helpers import (
    NAMES,
    TOOLS,
    counting_ids,
    random_splits,
    reassemble,
    stream,
    two_piece_splits,
)

HERMES_OUTPUTS = {
    "one call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "text then calls": ('Let me check.\n<tool_call>\n{"name": "search", "arguments": {"query": "say \\"hi\\" '
                        'caf\\u00e9 ☕ \\\\ {x}", "limit": -1.5e3}}\n</tool_call>\n<tool_call>{"name": "now"}'
                        '</tool_call>'),
    "name last": '<tool_call>{"arguments": {"city": "Nice", "unit": "C"}, "id": [1, {"a": null}], '
                 '"name": "get_weather"}</tool_call>',
    "no call": "Plain text, a < b, <tool> and <tool_call but no tag.\n",
    "unknown name": 'Hmm <tool_call>{"name": "rm", "arguments": {}}</tool_call> ok',
    "no name": '<tool_call>{"arguments": {"query": "q"}}</tool_call>',
    "broken after start": '<tool_call>{"name": "search", "arguments": {"query": tru}}</tool_call> Done.',
    "cut in arguments": 'One moment.\n<tool_call>{"name": "search", "arguments": {"query": "caf\\u00',
    "cut in the tag": "Almost <tool_ca",
    "text after": '<tool_call>{"name": "now"}</tool_call>\n\nThat is the time.',
    "no closing tags": '<tool_call>{"name": "now"}<tool_call>{"name": "now", "arguments": {}}',
    "empty": "",
}
LLAMA_OUTPUTS = {
    "one call": '{"name": "get_weather", "parameters": {"city": "Paris \\"centre\\"", "unit": "F"}}',
    "tag and calls": '<|python_tag|>{"name": "search", "parameters": {"query": "\\u00e9t\\u00e9"}}; {"name": "now"}',
    "plain": "  The answer is 42.",
    "json answer": '{"answer": {"value": 42}}',
    "text after": '{"name": "now", "parameters": {}}  and more',
    "broken after start": '{"name": "search", "parameters": {"query": 1.}}',
    "whitespace": " \n ",
}
REQUIRED_OUTPUTS = {
    "two calls": '[{"name": "search", "arguments": {"query": "a \\"b\\" \\u00e9"}}, {"name": "now", "arguments": {}}]',
    "cut": '[ {"name": "get_weather", "arguments": {"city": "Pa',
}
NAMED_OUTPUTS = {
    "arguments": ' {"city": "Par\\"is\\u00e9", "unit": "C"} ',
    "cut": '{"city": "Par',
}


def _parser(kind: str, parallel: bool = True) -> ToolCallParser:
    if kind in ("hermes", "llama3_json"):
        return parser_class(kind)(NAMES, parallel=parallel, make_id=counting_ids())
    choice = "required" if kind == "required" else {"type": "function", "function": {"name": "get_weather"}}
    request = parse_tool_request(TOOLS, choice, parallel)
    assert request is not None
    return guided_parser(request, counting_ids())


CASES = ([("hermes", name, text) for name, text in HERMES_OUTPUTS.items()]
         + [("llama3_json", name, text) for name, text in LLAMA_OUTPUTS.items()]
         + [("required", name, text) for name, text in REQUIRED_OUTPUTS.items()]
         + [("named", name, text) for name, text in NAMED_OUTPUTS.items()])


def _check_stream(kind: str, text: str, pieces: list[str], expected: ParsedOutput, parallel: bool = True) -> None:
    assert "".join(pieces) == text
    parser = _parser(kind, parallel)
    deltas = stream(parser, pieces)
    assert reassemble(deltas) == expected, pieces
    assert parser.result() == expected


@pytest.mark.parametrize(("kind", "text"), [case[::2] for case in CASES], ids=[f"{k}-{n}" for k, n, _ in CASES])
def test_every_split_reassembles_to_the_whole(kind, text):
    expected = _parser(kind).parse(text)
    _check_stream(kind, text, list(text), expected)  # one character at a time
    for pieces in two_piece_splits(text):
        _check_stream(kind, text, pieces, expected)
    for pieces in random_splits(text, seed=23, count=50):
        _check_stream(kind, text, pieces, expected)


def test_a_split_inside_the_tag_streams_the_text_before_it_at_once():
    parser = _parser("hermes")
    assert parser.feed("Let me check.").content == "Let me check."
    assert not parser.feed("\n<tool_")  # may be a call's start: held
    first = parser.feed('call>{"name": "now"')
    assert not first  # the name is known, but not yet whether arguments follow
    delta = parser.feed("}")
    assert [tc.to_openai() for tc in delta.tool_calls] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "now", "arguments": ""}},
        {"index": 0, "function": {"arguments": "{}"}}]
    assert delta.content == ""
    assert not parser.feed("</tool_")
    assert not parser.finish()


def test_arguments_stream_as_they_arrive_split_inside_escapes():
    parser = _parser("hermes")
    pieces = ['<tool_call>{"na', 'me": "search"', ', "argum', 'ents": {"query": "say \\', '"hi\\', '" caf\\u0',
              "0e9", '"}}', "</tool_call>"]
    fragments = []
    for piece in pieces:
        for tc in parser.feed(piece).tool_calls:
            fragments.append(tc.arguments if tc.id is None else ("HEADER", tc.name))
    assert fragments == [("HEADER", "search"), '{"query": "say \\', '"hi\\', '" caf\\u0', "0e9", '"}']
    assert parser.finish().tool_calls == ()


def test_content_is_never_sent_once_a_call_started_in_well_formed_output():
    for kind, text in [("hermes", HERMES_OUTPUTS["text then calls"]), ("llama3_json", LLAMA_OUTPUTS["tag and calls"])]:
        deltas = stream(_parser(kind), list(text))
        first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
        assert all(not d.content for d in deltas[first_call:])


def test_parallel_false_streams_one_call():
    text = '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "search", "arguments": {}}</tool_call>'
    expected = _parser("hermes", parallel=False).parse(text)
    assert len(expected.tool_calls) == 1
    for pieces in random_splits(text, seed=5, count=30):
        _check_stream("hermes", text, pieces, expected, parallel=False)


# Pieces models write, joined at random: outputs well-formed, malformed and in between.
_SOUP = ['<tool_call>', '</tool_call>', '<tool', '_call>', '<', '>', '{', '}', '[', ']', ':', ',', ';', ' ', '\n',
         '"name"', '"arguments"', '"parameters"', '"now"', '"search"', '"nope"', '"query"', '"q\\"x"', '"\\u00e9"',
         '"\\u', '"', '\\', '1', '-2.5e3', 'true', 'null', 'fals', 'text', '<|python_tag|>', 'é☕',
         '{"name": "now"}', '{"name": "search", "arguments": {"query": "q"}}', '<tool_call>{"name": "now"}']
_CALL_START = {"hermes": '<tool_call>{"name": "search", "arguments": {',
               "required": '[{"name": "search", "arguments": {'}


@pytest.mark.parametrize("kind", ["hermes", "llama3_json", "required", "named"])
def test_random_soup_never_fails_and_streams_like_the_whole(kind):
    rng = random.Random(2023)
    for _ in range(300):
        parts = [rng.choice(_SOUP) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.5:  # often the start of a real call, to reach deep states
            parts = [_CALL_START.get(kind, '{"name": "search", "arguments": {'), *parts]
        text = "".join(parts)
        expected = _parser(kind).parse(text)
        for name, call in enumerate(expected.tool_calls):
            assert call.id == f"call_{name}" and call.name in NAMES
        for pieces in random_splits(text, seed=len(text), count=5):
            _check_stream(kind, text, pieces, expected)
