"""One REST request yields linked spans in the gateway and the engine pod."""

from __future__ import annotations

import httpx

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tests.gateway.conftest import MODEL_NAME, POD_ARGS, gateway_config
from tests.otlp import otlp_collector, otlp_env  # noqa: F401 (fixture)

TRACE_ID, CALLER_SPAN_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def test_rest_request_spans_share_the_trace_with_correct_parents(tiny_llama, tmp_path, otlp_collector):
    collector, port = otlp_collector
    env = otlp_env(port)
    with EnginePodProcess(tiny_llama, POD_ARGS, env=env, log_path=tmp_path / "pod.log") as pod:
        pod.wait_serving()
        with GatewayProcess(gateway_config(tiny_llama, [(pod, "mixed")]), tmp_path, env=env,
                            log_path=tmp_path / "gateway.log") as gw:
            gw.wait_ready()
            r = httpx.post(gw.base_url + "/v1/completions",
                           json={"model": MODEL_NAME, "prompt": "tracing works", "max_tokens": 3},
                           headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"})
            assert r.status_code == 200
    # Both processes flushed their spans on SIGTERM.
    (server,) = collector.named("POST /v1/completions")
    (admission,) = collector.named("gateway.admission")
    (route,) = collector.named("gateway.route")
    (call,) = collector.named("gateway.engine_call")
    (engine,) = collector.named("engine.generate")
    for span in (server, admission, route, call, engine):
        assert span.trace_id.hex() == TRACE_ID
    assert server.parent_span_id.hex() == CALLER_SPAN_ID
    parents = {s.span_id: s.parent_span_id for _, s in collector.spans}

    def ancestors(span):
        chain, parent = [], span.parent_span_id
        while parent in parents:
            chain.append(parent)
            parent = parents[parent]
        return chain

    # FastAPI puts its endpoint span between the server span and ours.
    for child in (admission, route, call):
        assert server.span_id in ancestors(child)
    assert engine.parent_span_id == call.span_id
    services = {name: service for service, span in collector.spans for name in [span.name]}
    assert services["POST /v1/completions"] == "tessera-gateway"
    assert services["engine.generate"] != "tessera-gateway"
