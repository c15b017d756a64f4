"""What a new user meets first at the gateway and the engine pods, on real processes (one
simulated engine pod, `tessera engine --simulate`, behind a `tessera gateway`): gRPC server
reflection answers under both of its names (grpc.reflection.v1 and v1alpha), and every refused
request is counted once, with its reason, in the gateway's metrics."""

from __future__ import annotations

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from engine_pod.server.process import SimulatedPodsProcess
from gateway.process import GatewayProcess
from tessera.internal_secret import InternalSecret
from tests.conftest import TEST_INTERNAL_SECRET
from tests.gateway.conftest import MODEL_NAME, write_tenants

PROFILE = "engine_pod/sim/profiles/bench-cpu.json"
POD_ARGS = ["--max-model-len", "256", "--num-gpu-blocks", "64", "--drain-timeout", "5"]
SECRET = InternalSecret.from_text(TEST_INTERNAL_SECRET)
V1_METHOD = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"


@pytest.fixture(scope="module")
def sim_pod(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("sim") / "pod.log"
    with SimulatedPodsProcess(tiny_llama, PROFILE, 1, POD_ARGS, log_path=log) as pods:
        pods.wait_serving()
        yield pods


@pytest.fixture(scope="module")
def gateway(tiny_llama, sim_pod, tmp_path_factory):
    work = tmp_path_factory.mktemp("gateway")
    config = {"model": {"name": MODEL_NAME, "path": str(tiny_llama), "max_model_len": 256},
              "pods": {"static": [{"address": sim_pod.addresses[0]}]},
              "router": {"load_interval_ms": 50},
              "tenants_file": write_tenants(work / "tenants.yaml")}
    with GatewayProcess(config, work, log_path=work / "gateway.log") as gw:
        gw.wait_ready(num_pods=1)
        yield gw


class _Metadata(grpc.StreamStreamClientInterceptor):
    """Adds the deployment's internal token to every call (engine pods demand it)."""

    def intercept_stream_stream(self, continuation, details, request_iterator):
        details = details._replace(metadata=[*(details.metadata or ()), *SECRET.metadata()])
        return continuation(details, request_iterator)


def _channel(address: str, internal: bool) -> grpc.Channel:
    channel = grpc.insecure_channel(address)
    return grpc.intercept_channel(channel, _Metadata()) if internal else channel


def _services_v1alpha(channel: grpc.Channel) -> tuple[set[str], descriptor_pool.DescriptorPool]:
    """The services and their descriptors, as grpcio-reflection's own client (v1alpha) reads them."""
    database = ProtoReflectionDescriptorDatabase(channel)
    return set(database.get_services()), descriptor_pool.DescriptorPool(database)


def _services_v1(channel: grpc.Channel, pool: descriptor_pool.DescriptorPool) -> set[str]:
    """list_services over grpc.reflection.v1, with v1's messages as the server itself describes them."""
    request_type = message_factory.GetMessageClass(pool.FindMessageTypeByName(
        "grpc.reflection.v1.ServerReflectionRequest"))
    response_type = message_factory.GetMessageClass(pool.FindMessageTypeByName(
        "grpc.reflection.v1.ServerReflectionResponse"))
    call = channel.stream_stream(V1_METHOD, request_serializer=request_type.SerializeToString,
                                 response_deserializer=response_type.FromString)
    (response,) = call(iter([request_type(list_services="")]), timeout=10)
    assert response.DESCRIPTOR.full_name == "grpc.reflection.v1.ServerReflectionResponse"
    return {s.name for s in response.list_services_response.service}


@pytest.mark.parametrize("where", ["gateway", "engine pod"])
def test_reflection_answers_as_v1_and_v1alpha(where, request):
    if where == "gateway":
        address, internal, service = request.getfixturevalue("gateway").grpc_address, False, "tessera.v1.Inference"
    else:
        address, internal, service = request.getfixturevalue("sim_pod").addresses[0], True, "tessera.v1.Engine"
    expected = {service, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"}
    with _channel(address, internal) as channel:
        services, pool = _services_v1alpha(channel)
        assert services == expected
        # Both reflection services describe themselves, and the served service resolves.
        v1 = pool.FindServiceByName("grpc.reflection.v1.ServerReflection")
        assert v1.file.name == "grpc/reflection/v1/reflection.proto"
        assert v1.methods_by_name["ServerReflectionInfo"].input_type.full_name == \
            "grpc.reflection.v1.ServerReflectionRequest"
        assert pool.FindServiceByName(service).methods
        assert _services_v1(channel, pool) == expected


def test_reflection_v1_reports_an_unknown_symbol_as_not_found(gateway):
    """v1's error answer is v1's ErrorResponse: NOT_FOUND for a symbol nothing serves."""
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        call = channel.stream_stream(V1_METHOD,
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        (response,) = call(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.Such")]),
                           timeout=10)
    assert response.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


# -- every refusal counted once ------------------------------------------------


def test_every_refused_request_is_counted_once_with_its_reason(gateway):
    """Bad requests of every kind over REST and gRPC, then the gateway's own /metrics: each
    refusal once in tessera_gateway_rejections_total, with its reason, and once in
    tessera_gateway_requests_total{outcome="rejected"}."""
    from tests.gateway.conftest import KEYS
    from tests.gateway.observe import metric_sum
    from tessera.v1 import inference_pb2 as pb
    from tessera.v1 import inference_pb2_grpc as pb_grpc

    def auth(tenant: str) -> dict:
        return {"Authorization": f"Bearer {KEYS[tenant]}"}

    ok = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    image = {"model": MODEL_NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}]}]}
    rest = [  # (method, path, headers, body, reason)
        ("POST", "/v1/completions", {}, ok, "unauthenticated"),
        ("POST", "/v1/completions", auth("alice"), {**ok, "model": "gpt-none"}, "model_not_found"),
        ("GET", "/v1/models/gpt-none", auth("alice"), None, "model_not_found"),
        ("POST", "/v1/completions", auth("alice"), {**ok, "temperature": -1}, "invalid_request"),
        ("POST", "/v1/completions", auth("alice"), {**ok, "temprature": 1}, "invalid_request"),
        ("POST", "/v1/completions", auth("alice"), {**ok, "max_tokens": 100_000}, "invalid_request"),
        ("POST", "/v1/chat/completions", auth("alice"), image, "invalid_request"),
        ("POST", "/v1/load_lora_adapter", auth("alice"), {"lora_name": "x", "lora_path": "/a"}, "not_admin"),
        ("GET", "/v1/nothing", auth("alice"), None, "not_found"),
        ("PUT", "/v1/completions", auth("alice"), None, "method_not_allowed"),
        ("POST", "/v1/completions", auth("rpm"), ok, None),
        ("POST", "/v1/completions", auth("rpm"), ok, None),
        ("POST", "/v1/completions", auth("rpm"), ok, "requests_per_minute"),
    ]
    params = pb.GenerationParams(max_tokens=2)
    grpc_calls = [  # (tenant or None for a wrong key, request, reason)
        (None, pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=params), "unauthenticated"),
        ("grpc", pb.CompletionRequest(model="gpt-none", prompt="hi", params=params), "model_not_found"),
        ("grpc", pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=params, priority_class="no-such-class"),
         "invalid_request"),
        ("grpc", pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=pb.GenerationParams(
            max_tokens=2, temperature=-1)), "invalid_request"),
        # Refused while the message is read (before the pipeline counts anything).
        ("grpc", pb.CompletionRequest(model=MODEL_NAME, prompt="hi", prompt_token_ids=[1, 2], params=params),
         "invalid_request"),
        ("rpm-grpc", pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=params), None),
        ("rpm-grpc", pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=params), None),
        ("rpm-grpc", pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=params), "requests_per_minute"),
    ]
    with httpx.Client(base_url=gateway.base_url, timeout=30) as http:
        for method, path, headers, body, reason in rest:
            r = http.request(method, path, headers=headers, json=body)
            assert (r.status_code < 300) == (reason is None), (path, r.status_code, r.text)
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for tenant, request, reason in grpc_calls:
            key = KEYS[tenant] if tenant else "sk-wrong-0123456789"
            try:
                stub.CompleteUnary(request, metadata=(("authorization", f"Bearer {key}"),), timeout=30)
                assert reason is None, request
            except grpc.RpcError as e:
                assert reason is not None, e

    expected: dict[str, int] = {}
    for *_, reason in rest + grpc_calls:
        if reason is not None:
            expected[reason] = expected.get(reason, 0) + 1
    url = gateway.metrics_url
    assert {reason: metric_sum(url, "tessera_gateway_rejections_total", reason=reason) for reason in expected} \
        == expected
    assert metric_sum(url, "tessera_gateway_rejections_total") == sum(expected.values())
    assert metric_sum(url, "tessera_gateway_requests_total", outcome="rejected") == sum(expected.values())
    assert metric_sum(url, "tessera_gateway_requests_total", outcome="ok") == 4
