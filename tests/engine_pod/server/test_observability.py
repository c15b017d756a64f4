"""Prometheus metrics and OpenTelemetry spans of the engine pod."""

from __future__ import annotations

import asyncio


from engine_pod.server.process import EnginePodProcess
from tests.otlp import otlp_collector, otlp_env  # noqa: F401 (fixture)
from tests.engine_pod.server.client import generate_all, greedy, pod_aio_channel, scrape_metrics
from tests.engine_pod.server.conftest import POD_ARGS


def test_metrics_move_as_expected(pod):
    before = scrape_metrics(pod)
    prompts = [[5] * 10, [6] * 20, [7] * 30]
    max_tokens = [4, 8, 12]
    asyncio.run(generate_all(pod.address, [greedy(p, n, ignore_eos=True) for p, n in zip(prompts, max_tokens)]))
    after = scrape_metrics(pod)

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("tessera_prompt_tokens_total") == 60
    assert delta("tessera_generation_tokens_total") == 24
    assert delta("tessera_request_success_total", (("finished_reason", "length"),)) == 3
    assert delta("tessera_prefix_cache_queries_total") == 60
    assert delta("tessera_time_to_first_token_seconds_count") == 3
    assert delta("tessera_request_queue_time_seconds_count") == 3
    assert delta("tessera_e2e_request_latency_seconds_count") == 3
    assert delta("tessera_inter_token_latency_seconds_count") == sum(n - 1 for n in max_tokens)
    assert delta("tessera_e2e_request_latency_seconds_sum") > 0
    assert after[("tessera_num_requests_running", ())] == 0
    assert after[("tessera_kv_cache_usage_perc", ())] == 0


def test_request_span_is_a_child_of_the_callers_trace(tiny_llama, tmp_path, otlp_collector):
    collector, port = otlp_collector
    env = otlp_env(port)
    trace_id, parent_span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with EnginePodProcess(tiny_llama, POD_ARGS, env=env, log_path=tmp_path / "pod.log") as pod:
        pod.wait_serving()

        async def run():
            async with pod_aio_channel(pod.address) as channel:
                from tessera.v1 import engine_pb2_grpc as pb_grpc
                from tests.engine_pod.server.client import collect

                metadata = (("traceparent", f"00-{trace_id}-{parent_span_id}-01"),)
                return await collect(pb_grpc.EngineStub(channel), greedy([5] * 12, 3), metadata=metadata)

        tokens, _ = asyncio.run(run())
        assert len(tokens) == 3
    # SIGTERM shut the pod down, which flushes its span processor.
    spans = collector.named("tessera.v1.Engine/Generate")
    assert len(spans) == 1
    span = spans[0]
    assert span.trace_id.hex() == trace_id
    assert span.parent_span_id.hex() == parent_span_id
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gen_ai.usage.input_tokens"].int_value == 12
    assert attrs["gen_ai.usage.output_tokens"].int_value == 3
    assert {e.name for e in span.events} == {"scheduled", "first_token", "finished"}
