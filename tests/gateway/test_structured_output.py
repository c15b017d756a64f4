"""Guided decoding through the real platform (gateway + engine pods as
processes on loopback): REST with the official OpenAI SDK, the gateway's
gRPC API, and the engine pod's own gRPC API; bad constraints are refused
with 400 / INVALID_ARGUMENT naming the field, by the gateway's light checks
or, for what only the grammar compiler can judge, by the engine pod at
submit, before any token (and before any byte of a stream)."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import openai
import pytest

from engine_pod import SamplingParams
from tessera.structured_output import StructuredOutputsParams
from tessera_tools.bench.guided_workload import SCHEMAS
from tests.gateway.conftest import KEYS, MODEL_NAME, client
from tests.gateway.observe import metric_sum, pod_metrics_url
from tests.engine_pod.server.client import generate_all, pod_channel
from tessera.v1 import engine_pb2 as epb
from tessera.v1 import engine_pb2_grpc as epb_grpc
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc
from tessera.v1 import structured_output_pb2 as spb

MESSAGES = [{"role": "user", "content": "Give me a record as JSON."}]


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_chat_response_format_json_schema_validates(platform, schema):
    r = client(platform).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=128,
                                                 temperature=0, response_format=_json_schema_format(schema))
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_guided_greedy_equals_offline_llm_unary_and_streamed(platform, offline_llm):
    schema = SCHEMAS[2]
    prompt = "Tags and scores:"
    expected = offline_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=schema)))[0].outputs[0]
    c = client(platform)
    # The SDK's completions.create has no response_format argument; vLLM accepts it there too.
    r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=96, temperature=0,
                             extra_body={"response_format": _json_schema_format(schema)})
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=96, temperature=0, stream=True,
                                       extra_body={"guided_json": schema}))
    assert "".join(ch.choices[0].text for ch in chunks) == expected.text


def test_response_format_json_object(platform):
    c = client(platform)
    r = c.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=200, temperature=0,
                             extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)
    # Any object is allowed, so a random model may also write one key forever:
    # on this chat prompt it is still inside its first string at max_tokens.
    chat = c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0,
                                     response_format={"type": "json_object"})
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content.startswith('{"')
    plain = c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                      response_format={"type": "text"}, extra_body={"ignore_eos": True})
    assert plain.choices[0].finish_reason == "length" and not plain.choices[0].message.content.startswith('{"')


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"regex": r"[a-z]{2,5}-[0-9]{3}"}}, lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
    ({"guided_regex": r"(cat|dog) [0-9]{1,2}"}, lambda t: re.fullmatch(r"(cat|dog) [0-9]{1,2}", t)),
    ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}, lambda t: t in ("alpha", "beta", "gamma")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_grammar": 'root ::= "x=" [0-9] [0-9]? ";"'}, lambda t: re.fullmatch(r"x=[0-9]{1,2};", t)),
    ({"structured_outputs": {"json": SCHEMAS[0]}}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[0]) is None),
], ids=["so-regex", "guided_regex", "so-choice", "guided_choice", "guided_grammar", "so-json"])
def test_vllm_extra_fields(platform, extra, check):
    for prompt in ("The quick brown fox", "Pick one:"):
        r = client(platform).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=64, temperature=0,
                                                extra_body=extra)
        assert r.choices[0].finish_reason == "stop"
        assert check(r.choices[0].text), r.choices[0].text


def test_n_seeded_choices_each_follow_the_constraint(platform):
    r = client(platform).completions.create(model=MODEL_NAME, prompt="Colors:", n=4, max_tokens=8, temperature=1.0,
                                            seed=11, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in r.choices)


BAD_REST = [
    ({"response_format": _json_schema_format({"type": 5})}, "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not one of"),
    ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs",
     "structured_outputs.regex: invalid regex"),
    ({"extra_body": {"structured_outputs": {"regexp": "a"}}}, "structured_outputs", "unknown field(s) ['regexp']"),
    ({"extra_body": {"structured_outputs": {}}}, "structured_outputs", "give one of"),
    ({"extra_body": {"guided_grammar": "root ::= nothing"}}, "guided_grammar", "invalid grammar"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "the list of choices is empty"),
    ({"extra_body": {"guided_choice": "yes"}}, "guided_choice", "list"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json", "not valid JSON"),
    ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}}, "guided_choice",
     "give one output constraint, got guided_regex and guided_choice"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex",
     "got response_format and guided_regex"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs",
     "give only one constraint"),
]


@pytest.mark.parametrize("kwargs,param,message", BAD_REST, ids=[f"{p}-{i}" for i, (_, p, _m) in enumerate(BAD_REST)])
def test_bad_constraints_are_400_naming_the_field(platform, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        client(platform).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, **kwargs)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == param and message in body["message"], body
    assert body["type"] == "invalid_request_error"


# Constraints the gateway's light checks pass that xgrammar refuses: the engine
# pod answers INVALID_ARGUMENT at submit, which the gateway renders as the same
# 400 its own checks give, naming the client's field.
ENGINE_REFUSED = [
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "guided_grammar: invalid grammar: "),
    ({"structured_outputs": {"grammar": 'root ::= ("a"'}}, "structured_outputs",
     "structured_outputs.grammar: invalid grammar: "),
    ({"guided_regex": "(?=a)a"}, "guided_regex", "guided_regex: invalid regex: "),
    ({"response_format": _json_schema_format({"properties": {"a": {"$ref": "#/nope"}}})}, "response_format",
     "response_format: invalid JSON schema: "),
]


@pytest.mark.parametrize("body,param,message", ENGINE_REFUSED, ids=[p for _, p, _m in ENGINE_REFUSED])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_engine_refused_constraints_are_400_naming_the_field(platform, body, param, message, stream):
    r = httpx.post(platform.base_url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {KEYS['alice']}"},
                   json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "stream": stream, **body})
    # A status and OpenAI's error body, not a 200 event stream carrying an error.
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_structured_output"


# -- gRPC: the gateway's tessera.v1.Inference ------------------------------------

@pytest.fixture(scope="module")
def stub(platform):
    with grpc.insecure_channel(platform.grpc_address) as channel:
        yield pb_grpc.InferenceStub(channel)


def _auth():
    return (("authorization", f"Bearer {KEYS['grpc']}"),)


def test_grpc_complete_and_chat_guided(stub):
    schema = SCHEMAS[1]
    params = pb.GenerationParams(max_tokens=96, temperature=0,
                                 structured_outputs=spb.StructuredOutputs(json=json.dumps(schema)))
    unary = stub.CompleteUnary(pb.CompletionRequest(model=MODEL_NAME, prompt="A user:", params=params),
                               metadata=_auth())
    assert unary.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(unary.choices[0].text), schema)
    choice = spb.StructuredOutputs(choice=spb.StructuredOutputs.Choices(choices=["red", "green"]))
    chunks = list(stub.Chat(pb.ChatRequest(model=MODEL_NAME, messages=[pb.ChatMessage(role="user", content="hi")],
                                           params=pb.GenerationParams(max_tokens=8, temperature=0,
                                                                      structured_outputs=choice)),
                            metadata=_auth()))
    assert "".join(d.text for c in chunks for d in c.choices) in ("red", "green")


BAD_GRPC = [
    (spb.StructuredOutputs(json='{"type": 5}'), "params.structured_outputs.json: invalid JSON schema"),
    (spb.StructuredOutputs(regex="[a-"), "params.structured_outputs.regex: invalid regex"),
    (spb.StructuredOutputs(grammar="root ::= x"), "params.structured_outputs.grammar: invalid grammar"),
    (spb.StructuredOutputs(choice=spb.StructuredOutputs.Choices()), "the list of choices is empty"),
    (spb.StructuredOutputs(json_object=False), "json_object: must be true"),
    (spb.StructuredOutputs(), "set one of json, json_object, regex, choice, grammar"),
]


# The first three pass the gateway's light checks; the engine pod refuses them.
GRPC_ENGINE_REFUSED = [
    (spb.StructuredOutputs(grammar='root ::= "a" |'), "params.structured_outputs.grammar: invalid grammar: "),
    (spb.StructuredOutputs(regex="(?<=a)b"), "params.structured_outputs.regex: invalid regex: "),
    (spb.StructuredOutputs(json='{"properties": {"a": {"$ref": "#/nope"}}}'),
     "params.structured_outputs.json: invalid JSON schema: "),
]


@pytest.mark.parametrize("constraint,message", GRPC_ENGINE_REFUSED, ids=["grammar", "regex", "schema"])
def test_grpc_engine_refused_constraints_are_invalid_argument(stub, constraint, message):
    params = pb.GenerationParams(max_tokens=4, structured_outputs=constraint)
    for call in (stub.CompleteUnary, lambda req, **kw: list(stub.Complete(req, **kw))):
        with pytest.raises(grpc.RpcError) as err:
            call(pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=params), metadata=_auth())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(message), err.value.details()


@pytest.mark.parametrize("constraint,message", BAD_GRPC, ids=[m for _, m in BAD_GRPC])
def test_grpc_bad_constraints_are_invalid_argument(stub, constraint, message):
    params = pb.GenerationParams(max_tokens=4, structured_outputs=constraint)
    with pytest.raises(grpc.RpcError) as err:
        stub.CompleteUnary(pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=params), metadata=_auth())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


# -- gRPC: an engine pod's own tessera.v1.Engine ---------------------------------

def _engine_request(constraint: spb.StructuredOutputs, max_tokens: int = 48) -> epb.GenerateRequest:
    return epb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling_params=epb.SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=constraint))


def test_engine_pod_generate_guided_and_its_metrics(engine_pods, offline_llm):
    pod = engine_pods[0]

    def counter(name):
        return metric_sum(pod_metrics_url(pod), f"tessera_structured_output_{name}_total")

    before = {name: counter(name) for name in ("requests", "compiles", "cache_hits")}
    pattern = r"[0-9]{3}-[a-z]{2}"  # no other test sends this regex
    request = _engine_request(spb.StructuredOutputs(regex=pattern))
    results = asyncio_run(generate_all(pod.address, [request, request]))
    for tokens, reason in results:
        assert reason == "stop"
        assert re.fullmatch(pattern, offline_llm.get_tokenizer().decode(tokens, skip_special_tokens=True))
    assert counter("requests") - before["requests"] == 2
    assert counter("compiles") - before["compiles"] == 1
    assert counter("cache_hits") - before["cache_hits"] == 1
    assert metric_sum(pod_metrics_url(pod), "tessera_structured_output_compile_seconds_total") > 0


@pytest.mark.parametrize("constraint,message", [
    (spb.StructuredOutputs(json='{"properties": {"a": {"$ref": "#/nope"}}}'),
     "structured_outputs.json: invalid JSON schema"),
    (spb.StructuredOutputs(json="[1, 2]"), "structured_outputs.json: the schema must be a JSON object"),
    (spb.StructuredOutputs(regex="(ab"), "structured_outputs.regex: invalid regex"),
    (spb.StructuredOutputs(grammar="root ::= missing"), "structured_outputs.grammar: invalid grammar"),
    (spb.StructuredOutputs(choice=spb.StructuredOutputs.Choices(choices=["ok", ""])), "every choice must be"),
    (spb.StructuredOutputs(), "structured_outputs: set one of"),
], ids=["schema", "schema-array", "regex", "grammar", "empty-choice", "no-kind"])
def test_engine_pod_bad_constraints_are_invalid_argument(engine_pods, constraint, message):
    with pod_channel(engine_pods[0].address) as channel:
        stub = epb_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_engine_request(constraint), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)
