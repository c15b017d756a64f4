"""Tool calling through the gateway's REST API with the official OpenAI SDK.

- `required` and a named function against the real platform (gateway and
  tiny-model engine pods as processes): guided decoding makes every call's
  arguments valid against its function's schema, request after request.
- `auto` with the hermes and llama3_json parsers on scripted model outputs:
  a stand-in engine pod (a real gRPC server on loopback) streams the token
  ids of a scripted text in pieces that split tags, JSON strings and
  escapes, behind a real `Gateway` and its FastAPI app (httpx over ASGI);
  the streamed deltas reassemble to the non-streaming message.
- Refusals: bad tool definitions and misplaced tool messages are 400s in
  OpenAI's error shape naming the field, before any engine time.

The parsers themselves, at every split of many outputs, are tested in
tests/gateway/tool_calls/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import openai
import pytest

from gateway.config import gateway_config_from_dict
from gateway.grpc_service import InferenceService
from gateway.grpc_service import add_to_server as add_inference_service
from gateway.model import ServedModel
from gateway.openai_api.server import build_app
from gateway.pods import Pod
from gateway.priority import PriorityClasses
from gateway.serving import Gateway
from gateway.tenants import TenantRegistry
from tessera.internal_secret import InternalSecret
from tessera.v1 import engine_pb2 as epb
from tessera.v1 import engine_pb2_grpc as epb_grpc
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.conftest import KEYS, MODEL_NAME, client

# Small schemas: a random-weight model under guided decoding finishes them
# within a few dozen tokens (bounded strings, integers and enums only).
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
CONVERT = {"type": "object", "additionalProperties": False, "required": ["amount", "unit"],
           "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 999},
                          "unit": {"enum": ["km", "mi"]}}}
SCHEMAS = {"get_weather": WEATHER, "convert": CONVERT}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} function", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
PROMPTS = ["What is the weather in Paris?", "Convert 12 km to miles.", "Plan my week.", "hi",
           "Weather for Oslo, three days, please.", "How far is 40 miles?"]
CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")
MAX_TOKENS = 64


def _messages(i: int) -> list[dict]:
    return [{"role": "system", "content": "You call tools."}, {"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def _check_calls(message, names=frozenset(SCHEMAS)) -> None:
    """Every call names a tool and its arguments validate against the tool's schema."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert CALL_ID.fullmatch(call.id) and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _guided_request(i: int) -> dict:
    """Request i of the hundred: even ones name a function, odd ones are `required` (one call, so the
    output stays bounded); prompts, seeds and temperatures vary."""
    choice = {"type": "function", "function": {"name": "convert" if i % 4 == 0 else "get_weather"}} \
        if i % 2 == 0 else "required"
    return {"model": MODEL_NAME, "messages": _messages(i), "tools": TOOLS, "tool_choice": choice,
            "parallel_tool_calls": False, "max_tokens": MAX_TOKENS, "temperature": 0.7 + 0.05 * (i % 7),
            "seed": 1000 + i}


def test_required_and_named_calls_validate_in_100_of_100_requests(platform):
    c = client(platform)

    def one(i: int):
        return i, c.chat.completions.create(**_guided_request(i))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(100)))
    for i, r in results:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (i, choice)
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        _check_calls(choice.message)
        named = _guided_request(i)["tool_choice"]
        if isinstance(named, dict):
            assert choice.message.tool_calls[0].function.name == named["function"]["name"]
        assert r.usage.completion_tokens > 0


def test_required_with_parallel_calls_and_n_choices(platform):
    r = client(platform).chat.completions.create(
        model=MODEL_NAME, messages=_messages(0), tools=TOOLS, tool_choice="required", n=3, max_tokens=160,
        temperature=0.8, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message)
        ids = [call.id for call in choice.message.tool_calls]
        assert len(set(ids)) == len(ids)


def _reassembled(chunks) -> dict[int, dict]:
    """Each choice's message and finish reason from a stream, checking OpenAI's delta shape on the way:
    a call's first delta carries its id, type and name with empty arguments, later ones fragments only."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = out.setdefault(c.index, {"content": None, "tool_calls": {}, "finish_reason": None, "role": None})
            assert choice["finish_reason"] is None, "a delta after the finish"
            if c.delta.role:
                assert choice["role"] is None
                choice["role"] = c.delta.role
            if c.delta.content:
                choice["content"] = (choice["content"] or "") + c.delta.content
            for call in c.delta.tool_calls or ():
                calls = choice["tool_calls"]
                if call.id is not None:
                    assert call.index not in calls and call.index == len(calls)
                    assert call.type == "function" and call.function.arguments == ""
                    calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                else:
                    assert call.function.name is None and call.function.arguments
                    calls[call.index]["arguments"] += call.function.arguments
            if c.finish_reason:
                choice["finish_reason"] = c.finish_reason
    return out


def _as_dict(choice) -> dict:
    """A non-streamed choice in the shape of _reassembled's."""
    calls = {i: {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
             for i, call in enumerate(choice.message.tool_calls or ())}
    return {"content": choice.message.content, "tool_calls": calls, "finish_reason": choice.finish_reason,
            "role": choice.message.role}


def _without_ids(choice: dict) -> dict:
    for call in choice["tool_calls"].values():
        assert CALL_ID.fullmatch(call["id"])
    return {**choice, "tool_calls": {i: {**call, "id": None} for i, call in choice["tool_calls"].items()}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_guided_stream_reassembles_to_the_unary_answer(platform, tool_choice):
    c = client(platform)
    kwargs = dict(model=MODEL_NAME, messages=_messages(2), tools=TOOLS, tool_choice=tool_choice, n=2,
                  max_tokens=MAX_TOKENS, temperature=0.9, seed=42, parallel_tool_calls=False)
    unary = c.chat.completions.create(**kwargs)
    chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = _reassembled(chunks)
    assert {i: _without_ids(s) for i, s in streamed.items()} == \
        {choice.index: _without_ids(_as_dict(choice)) for choice in unary.choices}
    assert all(s["finish_reason"] == "tool_calls" for s in streamed.values())
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens


def test_logprobs_cover_every_generated_token(platform):
    r = client(platform).chat.completions.create(
        model=MODEL_NAME, messages=_messages(1), tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=MAX_TOKENS, temperature=0.5, seed=3, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.logprobs.content) == r.usage.completion_tokens


def test_a_conversation_with_earlier_calls_and_results(platform):
    """The agent loop's second turn: the assistant's call (content null) and the tool's result go back."""
    c = client(platform)
    first = c.chat.completions.create(model=MODEL_NAME, messages=_messages(0), tools=TOOLS, max_tokens=MAX_TOKENS,
                                      tool_choice="required", parallel_tool_calls=False, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [*_messages(0), first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = c.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("stop", "length")


# -- refusals, before any engine time -------------------------------------------

_WEATHER_TOOL = TOOLS[0]
BAD = [
    # (request fields, param, part of the message)
    ({"tools": [_WEATHER_TOOL, _WEATHER_TOOL], "tool_choice": "required"}, "tools[1].function.name",
     "already the name of another tool"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "5 is not of type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.type", "must be \"object\""),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"},
     "tools[0].function.name", "letters, digits, underscores or dashes"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type", "only \"function\" tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parmeters": {}}}], "tool_choice": "required"},
     "tools[0].function.parmeters", "unknown field"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not the name of a tool"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [], "tool_choice": "required"}, "tools", "the list is empty"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes", "tool_choice": "required"}, "parallel_tool_calls", "boolean"),
    # The model of this platform has no tool_call_parser: "auto" (the default with tools) cannot find calls.
    ({"tools": TOOLS}, "tool_choice", "needs a tool-call parser"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "needs a tool-call parser"),
    # One output constraint: the calls' schema leaves no room for another.
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": WEATHER}}},
     "tool_choice", "cannot be combined with response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "convert"}},
      "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined with response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a+"}}, "tool_choice",
     "cannot be combined with structured_outputs"),
    # Earlier calls and results in the wrong place, or malformed.
    ({"messages": [{"role": "user", "content": "hi",
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "convert", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "only an assistant message"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "convert", "arguments": "{\"amount\": "}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON text of an object"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]},
     "messages[1].tool_call_id", "required on a tool message"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "call_1"}]},
     "messages[0].tool_call_id", "only a tool message"),
]


@pytest.mark.parametrize("fields,param,message", BAD, ids=[f"{i}-{param}" for i, (_, param, _m) in enumerate(BAD)])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bad_tool_requests_are_400_naming_the_field(platform, fields, param, message, stream):
    body = {"model": MODEL_NAME, "messages": _messages(0), "max_tokens": 4, "stream": stream, **fields}
    r = httpx.post(platform.base_url + "/v1/chat/completions", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}


def test_the_sdk_sees_a_bad_tool_as_a_bad_request(platform):
    with pytest.raises(openai.BadRequestError) as err:
        client(platform).chat.completions.create(model=MODEL_NAME, messages=_messages(0), max_tokens=4,
                                                 tools=[_WEATHER_TOOL, _WEATHER_TOOL], tool_choice="required")
    assert err.value.body["param"] == "tools[1].function.name"


def test_a_schema_the_grammar_compiler_refuses_is_400_naming_the_tool(platform):
    dangling = {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}
    tools = [_WEATHER_TOOL, {"type": "function", "function": {"name": "broken", "parameters": dangling}}]
    for tool_choice, param in (("required", "tools"),
                               ({"type": "function", "function": {"name": "broken"}}, "tools[1]")):
        r = httpx.post(platform.base_url + "/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEYS['alice']}"},
                       json={"model": MODEL_NAME, "messages": _messages(0), "max_tokens": 4, "tools": tools,
                             "tool_choice": tool_choice})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "invalid JSON schema" in error["message"], error
        if param != "tools":
            assert error["message"].startswith("tools[1].function.parameters: "), error


# -- auto: scripted outputs through a stand-in engine pod -------------------------

SECRET = InternalSecret.from_text("tool-calls-e2e-tests-internal-secret-0123")
SPLIT = "¦"  # where a script is cut into the engine's responses (not part of the text)

HERMES_SCRIPT = (
    "Let me ch¦eck.\n<tool¦_call>\n{\"name\": \"get_¦weather\", \"arguments\": {\"city\": \"Par¦is \\¦\"centre\\\"\", "
    "\"days\": 3}¦}\n</tool_call>\n<tool_call>\n{\"name\": \"convert\", \"arguments\": {\"amount\": 1¦2, "
    "\"unit\": \"k¦m\"}}\n</tool_c¦all>"
)
HERMES_MESSAGE = {
    "role": "assistant", "content": "Let me check.", "finish_reason": "tool_calls",
    "tool_calls": {0: {"id": None, "name": "get_weather", "arguments": '{"city": "Paris \\"centre\\"", "days": 3}'},
                   1: {"id": None, "name": "convert", "arguments": "{\"amount\": 12, \"unit\": \"km\"}"}},
}
LLAMA3_SCRIPT = (
    "<|python_¦tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Ro¦me\", \"days\": ¦2}}; "
    "{\"name\": \"conv¦ert\", \"parameters\": {\"amount\": 5, \"unit\": \"m¦i\"}}"
)
LLAMA3_MESSAGE = {
    "role": "assistant", "content": None, "finish_reason": "tool_calls",
    "tool_calls": {0: {"id": None, "name": "get_weather", "arguments": "{\"city\": \"Rome\", \"days\": 2}"},
                   1: {"id": None, "name": "convert", "arguments": "{\"amount\": 5, \"unit\": \"mi\"}"}},
}
# It ends in what may be the start of a tag: hermes holds it back until the output's end.
PLAIN_SCRIPT = "No tools ne¦eded: it is {\"sun¦ny\"} <to¦ol> today <tool_¦ca"
PLAIN_MESSAGE = {"role": "assistant", "content": "No tools needed: it is {\"sunny\"} <tool> today <tool_ca",
                 "finish_reason": "stop", "tool_calls": {}}


class ScriptedPod(epb_grpc.EngineServicer):
    """An engine pod that answers every Generate with one scripted text: the
    token ids of each of its pieces in one response, the last with "stop"."""

    def __init__(self, served: ServedModel, script: str) -> None:
        self.pieces = [served.tokenizer.encode(piece, add_special_tokens=False) for piece in script.split(SPLIT)]
        self.prompts: list[list[int]] = []

    async def GetLoad(self, request, context):
        return epb.LoadReport(role="mixed", serving=True)

    async def Generate(self, request, context):
        self.prompts.append(list(request.prompt_token_ids))
        for i, ids in enumerate(self.pieces):
            yield epb.GenerateResponse(request_id=request.request_id, token_ids=ids,
                                       finish_reason="stop" if i == len(self.pieces) - 1 else "",
                                       num_prompt_tokens=len(request.prompt_token_ids))


@pytest.fixture(scope="module")
def served_model(tiny_llama) -> ServedModel:
    config = gateway_config_from_dict({"model": {"name": MODEL_NAME, "path": str(tiny_llama)},
                                       "pods": {"static": [{"address": "127.0.0.1:1"}]}})
    return ServedModel.load(config.model)


@contextlib.asynccontextmanager
async def scripted_gateway(served: ServedModel, pod: ScriptedPod, parser: str | None, grpc_api: bool = False):
    """A real Gateway in front of `pod`: the OpenAI SDK on its app over
    ASGI, or (`grpc_api`) a stub of its gRPC service on loopback."""
    servers = [grpc.aio.server()]
    epb_grpc.add_EngineServicer_to_server(pod, servers[0])
    address = f"127.0.0.1:{servers[0].add_insecure_port('127.0.0.1:0')}"
    await servers[0].start()
    config = gateway_config_from_dict({"model": {"name": MODEL_NAME, "path": "unused", "tool_call_parser": parser},
                                       "pods": {"static": [{"address": address}]}})
    gateway = Gateway(config, served, TenantRegistry.open_access(SECRET), PriorityClasses.from_config(None, None))
    gateway.pool.pods[address] = Pod(address, "mixed")
    gateway.pool.pods[address].on_report(epb.LoadReport(role="mixed", serving=True))
    try:
        if grpc_api:
            servers.append(grpc.aio.server())
            add_inference_service(InferenceService(gateway), servers[1])
            port = servers[1].add_insecure_port("127.0.0.1:0")
            await servers[1].start()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                yield pb_grpc.InferenceStub(channel)
        else:
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gateway)), base_url="http://gw")
            async with openai.AsyncOpenAI(base_url="http://gw/v1", api_key="unused", http_client=http,
                                          max_retries=0) as sdk:
                yield sdk
    finally:
        await gateway.close()
        for server in servers:
            await server.stop(None)


async def _unary_and_streamed(sdk, **kwargs):
    unary = await sdk.chat.completions.create(model=MODEL_NAME, messages=_messages(0), **kwargs)
    stream = await sdk.chat.completions.create(model=MODEL_NAME, messages=_messages(0), stream=True, **kwargs)
    return unary, [chunk async for chunk in stream]


@pytest.mark.parametrize("parser,script,expected", [
    ("hermes", HERMES_SCRIPT, HERMES_MESSAGE),
    ("llama3_json", LLAMA3_SCRIPT, LLAMA3_MESSAGE),
    ("hermes", PLAIN_SCRIPT, PLAIN_MESSAGE),
    ("llama3_json", PLAIN_SCRIPT, PLAIN_MESSAGE),
], ids=["hermes", "llama3_json", "hermes-plain", "llama3_json-plain"])
def test_auto_parses_scripted_outputs_unary_and_streamed(served_model, parser, script, expected):
    pod = ScriptedPod(served_model, script)
    assert len(pod.pieces) >= 4  # cut inside tags, strings and escapes

    async def scenario():
        async with scripted_gateway(served_model, pod, parser) as sdk:
            return await _unary_and_streamed(sdk, tools=TOOLS, max_tokens=MAX_TOKENS)

    unary, chunks = asyncio.run(scenario())
    assert _without_ids(_as_dict(unary.choices[0])) == expected
    streamed = _reassembled(chunks)
    assert list(streamed) == [0]
    assert _without_ids(streamed[0]) == expected
    # Each call's arguments came in several fragments: the pieces cut inside its JSON strings.
    fragments = [call.function.arguments for chunk in chunks for c in chunk.choices
                 for call in c.delta.tool_calls or () if call.id is None]
    assert len(fragments) >= (2 * len(expected["tool_calls"]) if expected["tool_calls"] else 0)


def test_auto_with_parallel_tool_calls_false_keeps_the_first_call(served_model):
    async def scenario():
        async with scripted_gateway(served_model, ScriptedPod(served_model, HERMES_SCRIPT), "hermes") as sdk:
            return await _unary_and_streamed(sdk, tools=TOOLS, parallel_tool_calls=False)

    unary, chunks = asyncio.run(scenario())
    expected = {**HERMES_MESSAGE, "tool_calls": {0: HERMES_MESSAGE["tool_calls"][0]}}
    assert _without_ids(_as_dict(unary.choices[0])) == expected
    assert _without_ids(_reassembled(chunks)[0]) == expected


def test_tool_choice_none_leaves_the_output_as_content(served_model):
    async def scenario():
        async with scripted_gateway(served_model, ScriptedPod(served_model, HERMES_SCRIPT), "hermes") as sdk:
            return await _unary_and_streamed(sdk, tools=TOOLS, tool_choice="none")

    unary, chunks = asyncio.run(scenario())
    text = HERMES_SCRIPT.replace(SPLIT, "")
    assert unary.choices[0].message.content == text and unary.choices[0].message.tool_calls is None
    assert unary.choices[0].finish_reason == "stop"
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == text


def test_each_of_n_choices_has_its_own_parser(served_model):
    async def scenario():
        async with scripted_gateway(served_model, ScriptedPod(served_model, LLAMA3_SCRIPT), "llama3_json") as sdk:
            return await _unary_and_streamed(sdk, tools=TOOLS, n=3)

    unary, chunks = asyncio.run(scenario())
    assert [_without_ids(_as_dict(c)) for c in unary.choices] == [LLAMA3_MESSAGE] * 3
    streamed = _reassembled(chunks)
    assert sorted(streamed) == [0, 1, 2] and all(_without_ids(s) == LLAMA3_MESSAGE for s in streamed.values())
    ids = [call.id for c in unary.choices for call in c.message.tool_calls]
    assert len(set(ids)) == 6  # every call its own id


# A template that writes tools, calls and results, as tool-calling templates do.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call id={{ c.id }}>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</call>{% endfor %}"
    "{% if m.tool_call_id %}<result of={{ m.tool_call_id }} name={{ m.name }}>{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_chat_template_gets_the_tools_the_calls_and_the_results(tiny_llama):
    served = ServedModel.load(gateway_config_from_dict({"model": {"name": MODEL_NAME, "path": str(tiny_llama)},
                                                        "pods": {"static": [{"address": "127.0.0.1:1"}]}}).model)
    served.tokenizer.chat_template = TOOL_TEMPLATE
    pod = ScriptedPod(served, PLAIN_SCRIPT)
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_abc", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_abc", "name": "get_weather", "content": "cold"},
    ]

    async def scenario():
        async with scripted_gateway(served, pod, "hermes") as sdk:
            await sdk.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS)

    asyncio.run(scenario())
    prompt = served.tokenizer.decode(pod.prompts[0])
    assert f"Tools: {json.dumps(TOOLS)}" in prompt
    # The arguments reach the template as an object (written with tojson), not as JSON text.
    assert "<|im_start|>assistant\n<call id=call_abc>get_weather {\"city\": \"Oslo\", \"days\": 1}</call>" in prompt
    assert "<|im_start|>tool\ncold<result of=call_abc name=get_weather>" in prompt


# -- gRPC Chat: the same, in the proto's fields ----------------------------------

GRPC_TOOLS = [pb.FunctionTool(name=name, description=f"the {name} function", parameters_json=json.dumps(schema))
              for name, schema in SCHEMAS.items()]


def _grpc_messages(i: int) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in _messages(i)]


def _grpc_auth():
    return (("authorization", f"Bearer {KEYS['grpc']}"),)


def _grpc_reassembled(chunks) -> dict[int, dict]:
    """Each choice's content, calls and finish reason from a Chat stream (the delta shape checked as on REST)."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for d in chunk.choices:
            choice = out.setdefault(d.index, {"content": "", "tool_calls": {}, "finish_reason": ""})
            assert not choice["finish_reason"], "a delta after the finish"
            choice["content"] += d.text
            for call in d.tool_calls:
                if call.id:
                    assert call.index == len(choice["tool_calls"]) and call.name and not call.arguments
                    choice["tool_calls"][call.index] = {"id": call.id, "name": call.name, "arguments": ""}
                else:
                    assert not call.name and call.arguments
                    choice["tool_calls"][call.index]["arguments"] += call.arguments
            choice["finish_reason"] = d.finish_reason
    return out


def _grpc_choice(c) -> dict:
    calls = {i: {"id": t.id, "name": t.name, "arguments": t.arguments} for i, t in enumerate(c.tool_calls)}
    return {"content": c.text, "finish_reason": c.finish_reason, "tool_calls": calls}


@pytest.mark.parametrize("choice", [pb.ToolChoice(mode="required"), pb.ToolChoice(function="convert")],
                         ids=["required", "named"])
def test_grpc_chat_guided_calls_validate_and_stream_as_unary(platform, choice):
    with grpc.insecure_channel(platform.grpc_address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.ChatRequest(model=MODEL_NAME, messages=_grpc_messages(1), tools=GRPC_TOOLS, tool_choice=choice,
                                 parallel_tool_calls=False,
                                 params=pb.GenerationParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, n=2))
        unary = stub.ChatUnary(request, metadata=_grpc_auth())
        chunks = list(stub.Chat(request, metadata=_grpc_auth()))
    for c in unary.choices:
        assert c.finish_reason == "tool_calls" and c.text == "" and len(c.tool_calls) == 1, c
        assert CALL_ID.fullmatch(c.tool_calls[0].id)
        name = c.tool_calls[0].name
        assert name == "convert" or choice.mode == "required"
        jsonschema.validate(json.loads(c.tool_calls[0].arguments), SCHEMAS[name])
    assert {i: _without_ids(s) for i, s in _grpc_reassembled(chunks).items()} == \
        {c.index: _without_ids(_grpc_choice(c)) for c in unary.choices}
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens


@pytest.mark.parametrize("request_fields,message", [
    ({"tools": [GRPC_TOOLS[0], GRPC_TOOLS[0]], "tool_choice": pb.ToolChoice(mode="required")},
     "tools[1].function.name: 'get_weather' is already the name of another tool"),
    ({"tools": [pb.FunctionTool(name="f", parameters_json="{nope")], "tool_choice": pb.ToolChoice(mode="required")},
     "tools[0].parameters_json: not valid JSON"),
    ({"tools": GRPC_TOOLS}, "tool_choice: \"auto\" needs a tool-call parser"),
    ({"tools": GRPC_TOOLS, "tool_choice": pb.ToolChoice(function="nope")}, "tool_choice.function.name"),
    ({"messages": [pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(role="tool", content="42")]},
     "messages[1].tool_call_id: required on a tool message"),
], ids=["duplicate", "parameters-json", "auto-without-parser", "unknown-function", "tool-message-without-id"])
def test_grpc_bad_tool_requests_are_invalid_argument(platform, request_fields, message):
    fields = {"messages": _grpc_messages(0), **request_fields}
    with grpc.insecure_channel(platform.grpc_address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ChatUnary(pb.ChatRequest(model=MODEL_NAME, params=pb.GenerationParams(max_tokens=4), **fields),
                           metadata=_grpc_auth())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details(), err.value


def test_grpc_chat_auto_parses_a_scripted_output_unary_and_streamed(served_model):
    pod = ScriptedPod(served_model, HERMES_SCRIPT)
    conversation = [pb.ChatMessage(role="user", content="Weather?"),
                    pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="get_weather",
                                                                             arguments='{"city": "Oslo"}')]),
                    pb.ChatMessage(role="tool", tool_call_id="call_1", content="cold"),
                    pb.ChatMessage(role="user", content="And Paris?")]

    async def scenario():
        async with scripted_gateway(served_model, pod, "hermes", grpc_api=True) as stub:
            request = pb.ChatRequest(model=MODEL_NAME, messages=conversation, tools=GRPC_TOOLS)
            unary = await stub.ChatUnary(request)
            return unary, [chunk async for chunk in stub.Chat(request)]

    unary, chunks = asyncio.run(scenario())
    expected = {**HERMES_MESSAGE, "content": "Let me check."}
    del expected["role"]
    assert _without_ids(_grpc_choice(unary.choices[0])) == expected
    assert _without_ids(_grpc_reassembled(chunks)[0]) == expected
    # Every token still reaches the client, calls' tokens included.
    assert [t for chunk in chunks for d in chunk.choices for t in d.token_ids] == list(unary.choices[0].token_ids)
