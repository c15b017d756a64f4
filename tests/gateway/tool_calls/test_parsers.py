"""The "auto" parsers on scripted model outputs, whole (non-streaming): calls,
content, and what malformed output becomes (never an exception)."""

from __future__ import annotations

import json

import pytest

from gateway.tool_calls import ParsedOutput, finish_reason, parser_class, parser_names
from gateway.tool_calls.limits import MAX_OUTPUT_JSON_DEPTH
from gateway.tool_calls.parsers import register
from tests.gateway.tool_calls.helpers import NAMES, counting_ids


def parse(parser: str, text: str, parallel: bool = True) -> ParsedOutput:
    return parser_class(parser)(NAMES, parallel=parallel, make_id=counting_ids()).parse(text)


def calls(output: ParsedOutput) -> list[tuple[str, str]]:
    return [(call.name, call.arguments_json) for call in output.tool_calls]


def test_the_registry_names_both_parsers_and_refuses_others():
    assert {"hermes", "llama3_json"} <= set(parser_names())
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'.*hermes"):
        parser_class("mistral")
    with pytest.raises(ValueError, match="registered twice"):
        register("hermes")(parser_class("hermes"))


# --- hermes ---------------------------------------------------------------------------------------------------


def test_hermes_single_call():
    out = parse("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert out.content is None
    assert calls(out) == [("get_weather", '{"city": "Paris"}')]
    assert [c.id for c in out.tool_calls] == ["call_0"]


def test_hermes_several_calls_with_text_before_them():
    text = ('I will look both up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "Paris \\"events\\"", '
            '"limit": 2}}\n</tool_call>\n')
    out = parse("hermes", text)
    assert out.content == "I will look both up."
    assert calls(out) == [("get_weather", '{"city": "Paris"}'),
                          ("search", '{"query": "Paris \\"events\\"", "limit": 2}')]
    assert json.loads(out.tool_calls[1].arguments_json) == {"query": 'Paris "events"', "limit": 2}
    assert [c.id for c in out.tool_calls] == ["call_0", "call_1"]


def test_hermes_arguments_keep_what_the_model_wrote():
    args = '{ "query" : "caf\\u00e9 ☕ {not a brace} \\\\", "limit":[1, -2.5e+3, true, null, {}] }'
    out = parse("hermes", f'<tool_call>{{"name": "search", "arguments": {args}}}</tool_call>')
    assert calls(out) == [("search", args)]
    assert json.loads(out.tool_calls[0].arguments_json)["query"] == "café ☕ {not a brace} \\"


def test_hermes_name_after_arguments_and_other_members():
    out = parse("hermes", '<tool_call>{"type": "function", "arguments": {"query": "q"}, "id": [1, {"a": 2}], '
                          '"name": "search"}</tool_call>')
    assert calls(out) == [("search", '{"query": "q"}')]


def test_hermes_no_arguments_is_the_empty_object():
    assert calls(parse("hermes", '<tool_call>{"name": "now"}</tool_call>')) == [("now", "{}")]


def test_hermes_text_only_is_content_as_written():
    text = "No tools needed: 2 < 3 and <tool> is not a tag; </tool_call> neither.\n\n"
    out = parse("hermes", text)
    assert out == ParsedOutput(text, ())


def test_hermes_text_after_a_call_is_content():
    out = parse("hermes", '<tool_call>{"name": "now"}</tool_call>\n\nThat was the time.')
    assert out.content == "That was the time." and calls(out) == [("now", "{}")]


def test_hermes_closing_tag_is_optional():
    out = parse("hermes", '<tool_call>{"name": "now"}\n<tool_call>{"name": "now", "arguments": {}}')
    assert calls(out) == [("now", "{}"), ("now", "{}")] and out.content is None


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',  # no such tool
    '<tool_call>{"name" "now"}</tool_call>',  # invalid JSON
    '<tool_call>{"arguments": {"query": "q"}}</tool_call>',  # no name
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',  # name not a string
    '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>',  # arguments a string
    '<tool_call>{"name": "now", "name": "search", "arguments": {}}</tool_call>',  # the name twice
    '<tool_call>["now"]</tool_call>',  # not an object
    "<tool_call>{'name': 'now'}</tool_call>",  # Python, not JSON
    '<tool_call>{"name": "no',  # cut before the call was certain
    '<tool_call>',
    '<tool_call>{"name": "now", "arguments": {}',  # cut: no arguments object closed yet...
], ids=["unknown name", "invalid JSON", "no name", "name not a string", "string arguments", "name twice",
        "not an object", "python", "cut in the name", "only the tag", "cut after arguments"])
def test_hermes_a_block_that_is_no_call_is_content(text):
    out = parse("hermes", "Sure. " + text)
    if text.endswith("{}"):  # ...but its arguments began: it was a call, kept whole
        assert calls(out) == [("now", "{}")] and out.content == "Sure."
        return
    assert out == ParsedOutput("Sure. " + text, ())


def test_hermes_a_call_that_breaks_after_it_began_keeps_what_was_read():
    text = ('<tool_call>{"name": "search", "arguments": {"query": tru}}</tool_call>\n'
            '<tool_call>{"name": "now"}</tool_call>\nDone.')
    out = parse("hermes", text)
    assert calls(out) == [("search", '{"query": tru'), ("now", "{}")]
    assert out.content == "Done."


def test_hermes_an_output_cut_in_the_arguments_keeps_them_cut():
    out = parse("hermes", 'Checking.\n<tool_call>\n{"name": "search", "arguments": {"query": "long que')
    assert out.content == "Checking." and calls(out) == [("search", '{"query": "long que')]
    assert finish_reason("length", out) == "length"


def test_hermes_parallel_false_keeps_the_first_call_only():
    text = '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "search", "arguments": {}}</tool_call>'
    assert calls(parse("hermes", text, parallel=False)) == [("now", "{}")]
    # A block that is no call does not count: the next one is still the first call.
    text = '<tool_call>{"name": "nope"}</tool_call><tool_call>{"name": "now"}</tool_call>'
    out = parse("hermes", text, parallel=False)
    assert calls(out) == [("now", "{}")] and out.content == '<tool_call>{"name": "nope"}</tool_call>'


def test_hermes_deep_nesting_is_malformed_not_a_crash():
    deep = "[" * (MAX_OUTPUT_JSON_DEPTH + 10)
    out = parse("hermes", '<tool_call>{"name": "search", "arguments": {"q": ' + deep)
    assert calls(out) == [("search", '{"q": ' + "[" * (MAX_OUTPUT_JSON_DEPTH - 2))]
    out = parse("hermes", "<tool_call>" + "{" * 10_000)
    assert out.tool_calls == () and out.content == "<tool_call>" + "{" * 10_000


# --- llama3_json ----------------------------------------------------------------------------------------------


def test_llama3_single_call():
    out = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}')
    assert out.content is None and calls(out) == [("get_weather", '{"city": "Paris", "unit": "C"}')]


def test_llama3_python_tag_and_several_calls():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "search", "arguments": {"query": "q"}};{"name": "now"}')
    out = parse("llama3_json", text)
    assert out.content is None
    assert calls(out) == [("get_weather", '{"city": "Paris"}'), ("search", '{"query": "q"}'), ("now", "{}")]


def test_llama3_text_is_content():
    text = "  The weather in Paris is mild. {\"name\": \"now\"} is how I would call a tool.\n"
    assert parse("llama3_json", text) == ParsedOutput(text, ())


@pytest.mark.parametrize("text", [
    '{"answer": 42}',  # a JSON answer, not a call
    '{"name": "Ada Lovelace", "parameters": {}}',  # a name that is no tool
    '<|python_tag|>print("hi")',  # code for the interpreter
    '{"name": "now", "parameters": [1]}',
    '{"name": "no',
    "<|python",
], ids=["json answer", "unknown name", "python code", "array parameters", "cut", "cut tag"])
def test_llama3_output_that_is_no_call_is_content(text):
    assert parse("llama3_json", text) == ParsedOutput(text, ())


def test_llama3_text_after_a_call_is_content():
    out = parse("llama3_json", '{"name": "now", "parameters": {}}\n\nI asked for the time.')
    assert calls(out) == [("now", "{}")] and out.content == "I asked for the time."


def test_llama3_a_broken_call_after_a_separator_is_content():
    out = parse("llama3_json", '{"name": "now", "parameters": {}}; {"name": "nope"}')
    assert calls(out) == [("now", "{}")] and out.content == '{"name": "nope"}'
    out = parse("llama3_json", '{"name": "now", "parameters": {}};  ')
    assert calls(out) == [("now", "{}")] and out.content is None


def test_llama3_a_call_that_breaks_after_it_began_drops_the_rest():
    out = parse("llama3_json", '{"name": "search", "parameters": {"query": "q",}}; {"name": "now"}')
    # The comma could still have been valid JSON: it was streamed.
    assert calls(out) == [("search", '{"query": "q",')] and out.content is None


def test_llama3_parallel_false_keeps_the_first_call_only():
    out = parse("llama3_json", '{"name": "now"}; {"name": "search", "parameters": {}}', parallel=False)
    assert calls(out) == [("now", "{}")] and out.content is None


# --- finish reason, message -----------------------------------------------------------------------------------


def test_finish_reason():
    with_call = parse("hermes", '<tool_call>{"name": "now"}</tool_call>')
    without = parse("hermes", "hello")
    assert finish_reason("stop", with_call) == "tool_calls"
    assert finish_reason("length", with_call) == "length"
    assert finish_reason("stop", without) == "stop"
    assert finish_reason("abort", with_call) == "abort"


def test_message_shape():
    out = parse("hermes", 'Hi.<tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call>')
    assert out.to_openai_message() == {
        "role": "assistant", "content": "Hi.",
        "tool_calls": [{"id": "call_0", "type": "function",
                        "function": {"name": "search", "arguments": '{"query": "q"}'}}]}
    assert parse("hermes", "plain").to_openai_message() == {"role": "assistant", "content": "plain"}
