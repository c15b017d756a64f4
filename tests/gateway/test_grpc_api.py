"""The public gRPC API (tessera.v1.Inference) on the generated stubs."""

from __future__ import annotations

import math
import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.gateway.conftest import KEYS, MODEL_NAME
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc


def _auth(tenant="grpc"):
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


@pytest.fixture(scope="module")
def stub(platform):
    with grpc.insecure_channel(platform.grpc_address) as channel:
        yield pb_grpc.InferenceStub(channel)


def test_streamed_completion_matches_unary_and_rest(platform, stub):
    from tests.gateway.conftest import client

    params = pb.GenerationParams(max_tokens=12, temperature=0, ignore_eos=True)
    req = pb.CompletionRequest(model=MODEL_NAME, prompt="The quick brown fox", params=params)
    chunks = list(stub.Complete(req, metadata=_auth()))
    text = "".join(d.text for c in chunks for d in c.choices)
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens > 0
    assert [d.finish_reason for c in chunks for d in c.choices][-1] == "length"
    unary = stub.CompleteUnary(req, metadata=_auth())
    assert unary.choices[0].text == text and len(unary.choices[0].token_ids) == 12
    rest = client(platform).completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert rest.choices[0].text == text


def test_chat_stream_with_two_choices(stub):
    req = pb.ChatRequest(model=MODEL_NAME, messages=[pb.ChatMessage(role="user", content="hello")],
                         params=pb.GenerationParams(max_tokens=5, temperature=0, n=2, ignore_eos=True))
    chunks = list(stub.Chat(req, metadata=_auth()))
    by_index = {}
    for c in chunks:
        for d in c.choices:
            by_index.setdefault(d.index, []).extend(d.token_ids)
    assert sorted(by_index) == [0, 1] and by_index[0] == by_index[1] and len(by_index[0]) == 5


def test_list_models(stub):
    models = stub.ListModels(pb.ListModelsRequest(), metadata=_auth()).models
    assert [m.id for m in models] == [MODEL_NAME] and models[0].max_model_len > 0


def test_unauthenticated_without_or_with_a_wrong_key(stub):
    req = pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=pb.GenerationParams(max_tokens=1))
    for metadata in ((), (("authorization", "Bearer sk-nope"),)):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Complete(req, metadata=metadata))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_invalid_argument_and_not_found(stub):
    bad = pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=pb.GenerationParams(temperature=9))
    with pytest.raises(grpc.RpcError) as err:
        stub.CompleteUnary(bad, metadata=_auth())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
    unknown = pb.CompletionRequest(model="other", prompt="hi")
    with pytest.raises(grpc.RpcError) as err:
        stub.CompleteUnary(unknown, metadata=_auth())
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_rate_limit_is_resource_exhausted_with_retry_hint(stub):
    req = pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=pb.GenerationParams(max_tokens=1))
    for _ in range(2):
        stub.CompleteUnary(req, metadata=_auth("rpm-grpc"))
    with pytest.raises(grpc.RpcError) as err:
        stub.CompleteUnary(req, metadata=_auth("rpm-grpc"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(err.value.trailing_metadata())
    # Rounded up, as REST's Retry-After: a client that waits that long is admitted.
    wait = float(re.search(r"retry after ([0-9.]+) s", err.value.details()).group(1))
    assert int(trailers["retry-after"]) == max(1, math.ceil(wait)), (trailers, err.value.details())


def test_health_and_reflection(platform):
    with grpc.insecure_channel(platform.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tessera.v1.Inference"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        services = {s.name for r in responses for s in r.list_services_response.service}
    assert {"tessera.v1.Inference", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
