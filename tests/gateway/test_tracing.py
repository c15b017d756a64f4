"""Traces by the OpenTelemetry semantic conventions: one REST request or gRPC
call is one trace, a CLIENT/SERVER pair per gRPC hop (client -> gateway,
gateway -> engine pod) with the RPC and GenAI attributes; health probes make
no spans. A real gateway and engine pod export to a real OTLP receiver."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tests.gateway.conftest import MODEL_NAME, POD_ARGS, gateway_config
from tests.otlp import Collector, otlp_env, running_collector
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc

TRACE_ID, CALLER_SPAN_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
GENERATE = "tessera.v1.Engine/Generate"


@pytest.fixture(scope="module")
def traced(tiny_llama, tmp_path_factory):
    """(collector, gateway, pod), both processes exporting spans every 100 ms."""
    tmp = tmp_path_factory.mktemp("tracing")
    with running_collector() as (collector, port):
        env = otlp_env(port)
        with EnginePodProcess(tiny_llama, POD_ARGS, env=env, log_path=tmp / "pod.log") as pod:
            pod.wait_serving()
            with GatewayProcess(gateway_config(tiny_llama, [(pod, "mixed")]), tmp, env=env,
                                log_path=tmp / "gateway.log") as gw:
                gw.wait_ready()
                yield collector, gw, pod


# Both sides of the gateway -> engine pod hop.
ENGINE_HOP = {(GENERATE, Span.SPAN_KIND_CLIENT), (GENERATE, Span.SPAN_KIND_SERVER)}


def _trace(collector: Collector, trace_id: bytes, wanted: set[tuple[str, int]], timeout: float = 20.0) -> dict:
    """The spans of one trace once every (name, kind) in `wanted` arrived: {(name, kind): span}."""
    deadline = time.monotonic() + timeout
    while True:
        spans = {(s.name, s.kind): s for _, s in list(collector.spans) if s.trace_id == trace_id}
        if wanted <= spans.keys() or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def _attrs(span) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(x) for x in v.array_value.values]
        return getattr(v, kind)
    return {a.key: value(a.value) for a in span.attributes}


def _service(collector: Collector, span) -> str:
    return next(service for service, s in collector.spans if s.span_id == span.span_id)


def _check_engine_hop(collector: Collector, spans: dict, parent) -> None:
    """The gateway's CLIENT span under `parent` and the pod's SERVER span under it."""
    client, server = spans[GENERATE, Span.SPAN_KIND_CLIENT], spans[GENERATE, Span.SPAN_KIND_SERVER]
    assert client.parent_span_id == parent.span_id
    assert server.parent_span_id == client.span_id
    assert _service(collector, client) == "tessera-gateway"
    assert _service(collector, server) != "tessera-gateway"
    for span in (client, server):
        a = _attrs(span)
        assert (a["rpc.system"], a["rpc.service"], a["rpc.method"]) == ("grpc", "tessera.v1.Engine", "Generate")
        assert a["rpc.grpc.status_code"] == 0
        assert span.status.code != Status.STATUS_CODE_ERROR
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        assert a["gen_ai.usage.output_tokens"] == 3
        assert a["gen_ai.usage.input_tokens"] > 0
    engine = _attrs(server)
    assert engine["gen_ai.request.max_tokens"] == 3
    assert engine["gen_ai.request.temperature"] == 0.0
    assert "first_token" in {e.name for e in client.events}


def _check_request_attributes(span, operation: str) -> None:
    a = _attrs(span)
    assert a["gen_ai.operation.name"] == operation
    assert a["gen_ai.request.model"] == MODEL_NAME
    assert a["gen_ai.request.max_tokens"] == 3
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == 1.0
    assert len(a["gen_ai.response.id"]) == 32
    # What the request answered, over its choices (one here).
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert (a["gen_ai.usage.output_tokens"], a["gen_ai.usage.input_tokens"] > 0) == (3, True)
    events = {e.name: _attrs(e) for e in span.events}
    assert events["admitted"]["tessera.queue_wait_seconds"] >= 0
    assert events["routed"]["tessera.cached_tokens"] >= 0


def test_a_rest_request_is_one_trace_of_client_server_pairs(traced):
    collector, gw, pod = traced
    r = httpx.post(gw.base_url + "/v1/completions",
                   json={"model": MODEL_NAME, "prompt": "tracing works", "max_tokens": 3, "temperature": 0},
                   headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"})
    assert r.status_code == 200, r.text
    spans = _trace(collector, bytes.fromhex(TRACE_ID), {("POST /v1/completions", Span.SPAN_KIND_SERVER)} | ENGINE_HOP)
    server = spans["POST /v1/completions", Span.SPAN_KIND_SERVER]
    assert server.parent_span_id.hex() == CALLER_SPAN_ID
    a = _attrs(server)
    assert (a["http.request.method"], a["http.route"], a["url.path"]) == ("POST", "/v1/completions", "/v1/completions")
    assert a["http.response.status_code"] == 200
    _check_request_attributes(server, "text_completion")
    assert r.json()["id"] == "cmpl-" + a["gen_ai.response.id"]
    _check_engine_hop(collector, spans, server)
    # The pipeline's own steps are children of the SERVER span too.
    assert spans["gateway.admission", Span.SPAN_KIND_INTERNAL].parent_span_id == server.span_id
    assert spans["gateway.route", Span.SPAN_KIND_INTERNAL].parent_span_id == server.span_id


def test_a_streamed_rest_request_records_its_answer_on_its_server_span(traced):
    collector, gw, pod = traced
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    with httpx.stream("POST", gw.base_url + "/v1/chat/completions",
                      json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "temperature": 0, "stream": True},
                      headers={"traceparent": f"00-{trace_id}-{CALLER_SPAN_ID}-01"}) as r:
        assert r.status_code == 200
        assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
    name = "POST /v1/chat/completions"
    spans = _trace(collector, bytes.fromhex(trace_id), {(name, Span.SPAN_KIND_SERVER)} | ENGINE_HOP)
    _check_request_attributes(spans[name, Span.SPAN_KIND_SERVER], "chat")


def test_a_grpc_call_is_one_trace_of_client_server_pairs(traced):
    collector, gw, pod = traced
    with grpc.insecure_channel(gw.grpc_address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.ChatRequest(model=MODEL_NAME, messages=[pb.ChatMessage(role="user", content="hi")],
                                 params=pb.GenerationParams(max_tokens=3, temperature=0))
        chunks = list(stub.Chat(request))
    assert chunks[-1].usage.completion_tokens == 3
    response_id = chunks[0].id
    deadline = time.monotonic() + 20
    while not (found := [s for _, s in list(collector.spans) if s.name == "tessera.v1.Inference/Chat"]):
        assert time.monotonic() < deadline, "no span for the gRPC call"
        time.sleep(0.05)
    (server,) = found
    assert server.kind == Span.SPAN_KIND_SERVER
    assert server.parent_span_id == b""  # the caller sent no traceparent: the trace starts here
    spans = _trace(collector, server.trace_id, ENGINE_HOP)
    a = _attrs(server)
    assert (a["rpc.system"], a["rpc.service"], a["rpc.method"]) == ("grpc", "tessera.v1.Inference", "Chat")
    assert a["rpc.grpc.status_code"] == 0
    _check_request_attributes(server, "chat")
    assert a["gen_ai.response.id"] == response_id
    _check_engine_hop(collector, spans, server)


def test_a_refused_grpc_call_records_its_status_code(traced):
    collector, gw, pod = traced
    with grpc.insecure_channel(gw.grpc_address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.CompleteUnary(pb.CompletionRequest(model="no-such-model", prompt="x"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    deadline = time.monotonic() + 20
    while not (found := [s for _, s in list(collector.spans) if s.name == "tessera.v1.Inference/CompleteUnary"]):
        assert time.monotonic() < deadline, "no span for the refused call"
        time.sleep(0.05)
    (span,) = found
    assert _attrs(span)["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    # The caller's mistake, not the server's failure (the RPC conventions for SERVER spans).
    assert span.status.code != Status.STATUS_CODE_ERROR


def test_health_probes_and_load_polls_make_no_spans(traced):
    collector, gw, pod = traced
    time.sleep(0.5)  # spans of earlier requests still on their way
    before = len(collector.spans)
    for path in ("/health", "/health/live", "/health/ready"):
        assert httpx.get(gw.base_url + path).status_code == 200
    for address in (gw.grpc_address, pod.address):
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    # Meanwhile the gateway polls the pod's load every 50 ms (router.load_interval_ms).
    time.sleep(1.0)
    assert [s.name for _, s in collector.spans[before:]] == []
