"""Prometheus metrics of an engine pod, with the meanings of vLLM's.

Gauges and the step counters are fed by the engine thread after each step;
per-request counters and latency histograms when a request's outputs reach
its stream (first token, each later token, the end).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine_pod.core.stats import SchedulerStats
from tessera.metrics_registry import component_registry

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or component_registry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("tessera_num_requests_running", "Requests in the running set")
        self.num_requests_waiting = gauge("tessera_num_requests_waiting", "Requests waiting to be scheduled")
        self.num_background_running = gauge("tessera_num_background_requests_running",
                                            "Background requests (batch lines) in the running set")
        self.num_background_waiting = gauge("tessera_num_background_requests_waiting",
                                            "Background requests (batch lines) waiting to be scheduled")
        self.kv_cache_usage = gauge("tessera_kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)")
        self.prefix_cache_queries = counter("tessera_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("tessera_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_preemptions = counter("tessera_num_preemptions", "Requests preempted (recompute)")
        self.steps_in_flight = gauge("tessera_steps_in_flight", "Engine steps submitted and not yet applied "
                                     "(up to one per pipeline stage; 0 without pipeline parallelism)")
        # Mean accepted length = 1 + accepted_tokens / drafts; acceptance rate = accepted / draft_tokens.
        self.spec_decode_num_drafts = counter(
            "tessera_spec_decode_num_drafts", "Verification steps of a request that carried drafts")
        self.spec_decode_num_draft_tokens = counter(
            "tessera_spec_decode_num_draft_tokens", "Draft tokens verified by the target model")
        self.spec_decode_num_accepted_tokens = counter(
            "tessera_spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.prompt_tokens = counter("tessera_prompt_tokens", "Prompt tokens processed (counted at the first token)")
        self.generation_tokens = counter("tessera_generation_tokens", "Generated tokens")
        self._request_success = Counter(
            "tessera_request_success", "Finished requests by finish reason", labels + ["finished_reason"], registry=r
        )
        self._model = model_name
        self.queue_time = histogram("tessera_request_queue_time_seconds", "Arrival to first scheduled",
                                    _LATENCY_BUCKETS)
        self.ttft = histogram("tessera_time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS)
        self.itl = histogram("tessera_inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS)
        self.e2e = histogram("tessera_e2e_request_latency_seconds", "Arrival to finish", _LATENCY_BUCKETS)
        # Per LoRA adapter: its label values are the names the pod serves (an operator's or admin's
        # choice), never a client's string.
        self._lora_requests = Counter("tessera_lora_requests", "Requests on a LoRA adapter",
                                      labels + ["lora_name"], registry=r)
        self._lora_generation_tokens = Counter("tessera_lora_generation_tokens", "Tokens generated on a LoRA adapter",
                                               labels + ["lora_name"], registry=r)

    def on_step(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.num_background_running.set(stats.num_background_running)
        self.num_background_waiting.set(stats.num_background_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions)
        self.steps_in_flight.set(stats.steps_in_flight)
        self.spec_decode_num_drafts.inc(stats.spec_decode.num_drafts)
        self.spec_decode_num_draft_tokens.inc(stats.spec_decode.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(stats.spec_decode.num_accepted_tokens)

    def on_first_token(self, num_prompt_tokens: int, arrival: float, scheduled: float | None, now: float) -> None:
        """The prompt is fully processed: count it, and the request's waits."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.ttft.observe(max(0.0, now - arrival))
        if scheduled is not None:
            self.queue_time.observe(max(0.0, scheduled - arrival))

    def on_tokens(self, num_tokens: int, since_last: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if since_last is not None:
            self.itl.observe(since_last)

    def on_lora_request(self, lora_name: str) -> None:
        self._lora_requests.labels(self._model, lora_name).inc()

    def on_lora_tokens(self, lora_name: str, num_tokens: int) -> None:
        self._lora_generation_tokens.labels(self._model, lora_name).inc(num_tokens)

    def on_finished(self, reason: str, arrival: float, end: float) -> None:
        self._request_success.labels(self._model, reason).inc()
        self.e2e.observe(max(0.0, end - arrival))


class KVStoreCollector:
    """Exposes the tiered KV store's counters at scrape time (no hot-path cost)."""

    def __init__(self, store, model_name: str) -> None:
        self.store = store
        self.model_name = model_name

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            SummaryMetricFamily,
        )

        s, labels = self.store.stats, ["model_name"]
        m = [self.model_name]

        def counter(name, doc, value):
            fam = CounterMetricFamily(name, doc, labels=labels)
            fam.add_metric(m, value)
            return fam

        def per_label(name, doc, label, values: dict):
            fam = CounterMetricFamily(name, doc, labels=labels + [label])
            for key, value in values.items():
                fam.add_metric(m + [key], value)
            return fam

        yield counter("tessera_kv_store_lookups", "Blocks looked up in the KV store", s.lookups)
        yield per_label("tessera_kv_store_hits", "Blocks loaded from the KV store", "tier",
                        {"host": s.host_hits, "inbox": s.inbox_hits, "redis": s.redis_hits})
        yield per_label("tessera_kv_store_read_bytes", "Bytes read from the KV store", "tier",
                        {"host": s.bytes_read_host, "inbox": s.bytes_read_inbox, "redis": s.bytes_read_redis})
        yield per_label("tessera_kv_store_written_bytes", "Bytes written to the KV store", "tier",
                        {"host": s.bytes_written_host, "redis": s.bytes_written_redis})
        channels = ("redis", "direct")
        yield per_label("tessera_kv_transfer_bytes", "P/D transfer bytes sent by this pod, by channel", "channel",
                        {c: s.transfer_bytes[c] for c in channels})
        yield per_label("tessera_kv_transfer_seconds", "Seconds this pod spent on P/D transfers, by channel",
                        "channel", {c: s.transfer_seconds[c] for c in channels})
        yield per_label("tessera_kv_transfer_pushes", "Direct P/D pushes by outcome (ok, fallback: sent to Redis "
                        "instead, failed: neither)", "outcome", {o: s.pushes[o] for o in ("ok", "fallback", "failed")})
        yield per_label("tessera_kv_transfer_push_paths", "Direct P/D pushes a decode pod took, by data path (socket: "
                        "its inbox socket, grpc: the PushKVBlocks stream)", "path",
                        {p: s.push_paths[p] for p in ("socket", "grpc")})
        yield counter("tessera_kv_store_inbox_received_bytes", "Bytes prefill pods pushed into this pod's inbox",
                      s.bytes_received_inbox)
        yield counter("tessera_kv_store_write_drops", "Redis writes dropped (write-behind queue full)",
                      s.writes_dropped)
        yield self._rejected(labels, m)
        summary = SummaryMetricFamily("tessera_kv_store_load_seconds", "Time to load a run of blocks", labels=labels)
        summary.add_metric(m, count_value=s.loads, sum_value=s.load_seconds)
        yield summary
        host = GaugeMetricFamily("tessera_kv_store_host_bytes", "Bytes held by the host tier", labels=labels)
        host.add_metric(m, self.store.host.used_bytes)
        yield host
        inbox = GaugeMetricFamily("tessera_kv_store_inbox_bytes", "Bytes held by the inbox of pushed blocks",
                                  labels=labels)
        inbox.add_metric(m, self.store.inbox.used_bytes if self.store.inbox is not None else 0)
        yield inbox
        remote = self.store.remote
        if remote is not None:
            up = GaugeMetricFamily("tessera_kv_store_redis_up", "1 if the last Redis call succeeded", labels=labels)
            up.add_metric(m, 1.0 if remote.available else 0.0)
            yield up
            yield counter("tessera_kv_store_redis_errors", "Failed Redis calls", remote.errors)

    def _rejected(self, labels, m):
        """Refused stored values by tier and reason (truncated, format, mac,
        misaddressed: kv_store/codec.py); every pair is exposed, zeros too,
        so an alert on reason="mac" needs no absent-series handling."""
        from prometheus_client.core import CounterMetricFamily

        from kv_store.codec import REJECT_REASONS

        fam = CounterMetricFamily("tessera_kv_store_rejected_values",
                                  "Stored blocks refused on read (and deleted), by tier and reason",
                                  labels=labels + ["tier", "reason"])
        tiers = ("host", "inbox", "redis") if self.store.remote is not None else ("host", "inbox")
        for tier in tiers:
            for reason in REJECT_REASONS:
                fam.add_metric(m + [tier, reason], self.store.stats.rejected[(tier, reason)])
        return fam


class PipelineStageCollector:
    """Each pipeline stage's step figures (its TP rank 0's), read at scrape
    time from the workers' shared board and the other nodes' heartbeats: the
    bubble fraction over an interval is 1 - sum(rate(busy)) / (stages x 1 s)."""

    def __init__(self, executor, model_name: str) -> None:
        self.executor = executor  # executor/abstract.Executor
        self.model_name = model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        from engine_pod.worker.stage_timing import stage_leaders

        labels = ["model_name", "stage"]
        families = (
            ("tessera_pipeline_stage_steps", "Non-empty engine steps the stage ran", lambda t: t.steps),
            ("tessera_pipeline_stage_busy_seconds", "Seconds the stage computed within its steps",
             lambda t: t.busy_seconds),
            ("tessera_pipeline_stage_wait_seconds", "Seconds the stage waited within its steps for the previous "
             "stage's hidden states or for the next stage to take its own", lambda t: t.wait_seconds),
        )
        leaders = stage_leaders(self.executor.stage_timings())
        for name, doc, value in families:
            fam = CounterMetricFamily(name, doc, labels=labels)
            for timing in leaders:
                fam.add_metric([self.model_name, str(timing.stage)], value(timing))
            yield fam


class StructuredOutputCollector:
    """Guided-decoding counters of the engine core, read at scrape time."""

    def __init__(self, stats, model_name: str) -> None:
        self.stats = stats  # structured_output.manager.StructuredOutputStats, updated in place
        self.model_name = model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        s = self.stats
        for name, doc, value in (
            ("tessera_structured_output_requests", "Guided requests (structured outputs) added", s.num_requests),
            ("tessera_structured_output_compiles", "Grammars compiled (compile-cache misses)", s.num_compiles),
            ("tessera_structured_output_cache_hits", "Guided requests served a cached grammar", s.num_cache_hits),
            ("tessera_structured_output_compile_seconds", "Time spent compiling grammars", s.compile_seconds),
        ):
            fam = CounterMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], value)
            yield fam


class LoRACollector:
    """The adapters a pod serves, which are in host memory, and how long each
    took to read, at scrape time."""

    def __init__(self, registry, loader, model_name: str) -> None:
        self.registry = registry  # server/lora_registry.LoRARegistry
        self.loader = loader  # engine/lora_loader.LoRALoader
        self.model_name = model_name

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        resident = GaugeMetricFamily("tessera_lora_adapter_resident", "1 for a served adapter whose weights are "
                                     "in host memory, 0 for one that is read on its next request",
                                     labels=["model_name", "lora_name"])
        seconds = GaugeMetricFamily("tessera_lora_load_seconds", "Seconds the last read of the adapter took",
                                    labels=["model_name", "lora_name"])
        resident_ids = self.loader.resident_ids
        load_seconds = dict(self.loader.load_seconds)
        for spec in self.registry.adapters():
            resident.add_metric([self.model_name, spec.name], float(spec.lora_int_id in resident_ids))
            if spec.name in load_seconds:
                seconds.add_metric([self.model_name, spec.name], load_seconds[spec.name])
        yield resident
        yield seconds


class InFlightCollector:
    """The pod's request-seconds in flight (in_flight.py), read at scrape
    time: its rate is the pod's mean concurrency, the autoscaler's signal."""

    NAME = "tessera_request_in_flight_seconds"

    def __init__(self, in_flight, model_name: str) -> None:
        self.in_flight = in_flight  # in_flight.InFlightSeconds
        self.model_name = model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        fam = CounterMetricFamily(self.NAME, "Integral over time of the requests in flight on the pod "
                                  "(request-seconds; its rate is the mean concurrency)", labels=["model_name"])
        fam.add_metric([self.model_name], self.in_flight.total())
        yield fam
