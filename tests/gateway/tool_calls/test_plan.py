"""The entry point the request path calls, and the wire shape as the OpenAI
SDK reads it: a stream of chunks built from the deltas, accumulated by the
SDK's own stream state, equals the non-streaming message."""

from __future__ import annotations

import random

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.errors import GatewayError
from gateway.tool_calls import ToolCallParser, finish_reason, plan_tool_calls
from gateway.tool_calls.guided_output import NamedCallParser, RequiredCallsParser
from gateway.tool_calls.parsers.hermes import HermesParser
from gateway.tool_calls.parsers.llama3_json import Llama3JsonParser
from tests.gateway.tool_calls.helpers import TOOLS, counting_ids, random_splits


def test_no_tools_no_plan():
    assert plan_tool_calls(None, None, None, "hermes") is None


def test_auto_uses_the_configured_parser():
    plan = plan_tool_calls(TOOLS, None, None, parser_name="llama3_json")
    assert plan is not None and plan.constraint is None
    assert isinstance(plan.new_parser(), Llama3JsonParser)
    assert plan.template_tools == TOOLS


def test_auto_without_a_parser_is_a_400():
    with pytest.raises(GatewayError) as raised:
        plan_tool_calls(TOOLS, "auto", None, parser_name=None)
    assert raised.value.status == 400 and raised.value.param == "tool_choice"


def test_an_unknown_parser_is_a_configuration_error_not_a_400():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        plan_tool_calls(TOOLS, None, None, parser_name="nope")


def test_none_keeps_the_tools_for_the_template_but_parses_nothing():
    plan = plan_tool_calls(TOOLS, "none", None, parser_name=None)
    assert plan is not None and plan.constraint is None and plan.new_parser() is None
    assert plan.template_tools == TOOLS


@pytest.mark.parametrize(("choice", "parser"), [("required", RequiredCallsParser),
                                                ({"type": "function", "function": {"name": "search"}},
                                                 NamedCallParser)])
def test_required_and_named_are_guided_without_a_configured_parser(choice, parser):
    plan = plan_tool_calls(TOOLS, choice, False, parser_name=None)
    assert plan is not None and plan.constraint is not None and plan.constraint.kind == "json"
    assert isinstance(plan.new_parser(), parser)


def test_each_choice_gets_its_own_parser():
    plan = plan_tool_calls(TOOLS, None, None, parser_name="hermes")
    assert plan is not None
    first, second = plan.new_parser(), plan.new_parser()
    assert isinstance(first, HermesParser) and first is not second


def _chunk(delta: dict, finish: str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def _stream_through_the_sdk(parser: ToolCallParser, pieces: list[str], engine_reason: str) -> dict:
    """What the gateway will send, as the SDK accumulates it."""
    state = ChatCompletionStreamState()
    state.handle_chunk(_chunk({"role": "assistant"}))
    for piece in pieces:
        delta = parser.feed(piece)
        if delta:
            state.handle_chunk(_chunk(delta.to_openai()))
    last = parser.finish()
    state.handle_chunk(_chunk(last.to_openai(), finish_reason(engine_reason, parser.result())))
    # The snapshot, not get_final_completion(): that one refuses a "length" finish.
    return _essentials(state.current_completion_snapshot.choices[0])


def _non_streaming(parser: ToolCallParser, text: str, engine_reason: str) -> dict:
    output = parser.parse(text)
    completion = ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": output.to_openai_message(),
                     "finish_reason": finish_reason(engine_reason, output)}]})
    return _essentials(completion.choices[0])


def _essentials(choice) -> dict:
    """What a client reads of a choice (the SDK's snapshot adds fields of its own, such as each call's index)."""
    message = choice.message
    calls = [{"id": c.id, "type": c.type, "name": c.function.name, "arguments": c.function.arguments}
             for c in message.tool_calls or []]
    return {"finish_reason": choice.finish_reason, "role": message.role, "content": message.content,
            "tool_calls": calls}


SDK_CASES = [
    ("hermes", None, 'Checking.\n<tool_call>\n{"name": "search", "arguments": {"query": "caf\\u00e9 \\"x\\""}}\n'
                     '</tool_call>\n<tool_call>{"name": "now"}</tool_call>', "stop"),
    ("hermes", None, "Just text.", "stop"),
    ("llama3_json", None, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "stop"),
    (None, "required", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}]',
     "stop"),
    (None, {"type": "function", "function": {"name": "search"}}, '{"query": "q", "limit": 1}', "stop"),
    ("hermes", None, '<tool_call>{"name": "search", "arguments": {"query": "cut sh', "length"),
]


@pytest.mark.parametrize(("parser_name", "choice", "text", "engine_reason"), SDK_CASES,
                         ids=["hermes", "hermes-text", "llama3", "required", "named", "cut"])
def test_the_sdk_rebuilds_the_stream_into_the_non_streaming_message(parser_name, choice, text, engine_reason):
    plan = plan_tool_calls(TOOLS, choice, None, parser_name=parser_name)
    assert plan is not None
    whole = plan.new_parser(counting_ids())
    assert whole is not None
    expected = _non_streaming(whole, text, engine_reason)
    for pieces in [list(text), *random_splits(text, seed=3, count=10)]:
        parser = plan.new_parser(counting_ids())
        assert parser is not None
        assert _stream_through_the_sdk(parser, pieces, engine_reason) == expected
    if expected["tool_calls"] and engine_reason == "stop":
        assert expected["finish_reason"] == "tool_calls"


def test_a_long_output_is_read_in_one_pass():
    # 100 000 characters of arguments, whole and in 4-character pieces (a quadratic step would take minutes).
    value = "".join(random.Random(1).choice("abc \\\"é") for _ in range(100_000)).replace("\\", "\\\\").replace(
        '"', '\\"')
    text = '<tool_call>{"name": "search", "arguments": {"query": "' + value + '"}}</tool_call>'
    plan = plan_tool_calls(TOOLS, None, None, parser_name="hermes")
    assert plan is not None
    whole = plan.new_parser()
    assert whole is not None
    assert len(whole.parse(text).tool_calls[0].arguments_json) == len(value) + 13
    parser = plan.new_parser()
    assert parser is not None
    for i in range(0, len(text), 4):
        parser.feed(text[i:i + 4])
    parser.finish()
    assert parser.result().tool_calls[0].arguments_json == whole.result().tool_calls[0].arguments_json
