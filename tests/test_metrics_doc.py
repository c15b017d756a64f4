"""docs/metrics.md lists exactly the metrics each component serves, so the page cannot drift.

The registries are the components' own (GatewayMetrics, EngineMetrics with every scrape-time
collector an engine pod registers: KV store with Redis, guided decoding, LoRA, in-flight).
tests/tessera_tools/up/test_up_monitoring.py checks real scrapes against the page too."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine_pod.server.in_flight import InFlightSeconds
from engine_pod.server.metrics import (
    EngineMetrics,
    InFlightCollector,
    KVStoreCollector,
    LoRACollector,
    PipelineStageCollector,
    StructuredOutputCollector,
)
from engine_pod.structured_output.manager import StructuredOutputStats
from engine_pod.worker.stage_timing import StageTiming
from gateway.metrics import GatewayMetrics
from kv_store.tiered_store import KVStoreStats

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
_ROW = re.compile(r"^\| `([a-z0-9_:]+)` \| (counter|gauge|histogram|summary) \|")


def documented_metrics(doc: Path = DOC) -> dict[str, dict[str, str]]:
    """Each `## ` section of the page: {metric name: type} from its tables' rows."""
    sections: dict[str, dict[str, str]] = {}
    current = None
    for line in doc.read_text().splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), {})
        elif (m := _ROW.match(line)) and current is not None:
            current[m.group(1)] = m.group(2)
    return sections


def served_metrics(text: str) -> dict[str, str]:
    """{name as the page writes it: type} of a scrape: a counter with its `_total`."""
    return {(f.name + "_total" if f.type == "counter" else f.name): f.type
            for f in text_string_to_metric_families(text)}


def gateway_scrape() -> str:
    return generate_latest(GatewayMetrics().registry).decode()


def engine_scrape() -> str:
    metrics = EngineMetrics("tiny")
    r: CollectorRegistry = metrics.registry
    store = SimpleNamespace(stats=KVStoreStats(), host=SimpleNamespace(used_bytes=0), inbox=None,
                            remote=SimpleNamespace(available=True, errors=0))
    r.register(KVStoreCollector(store, "tiny"))
    r.register(StructuredOutputCollector(StructuredOutputStats(), "tiny"))
    adapters = SimpleNamespace(adapters=lambda: [SimpleNamespace(name="sql", lora_int_id=1)])
    r.register(LoRACollector(adapters, SimpleNamespace(resident_ids=frozenset({1}), load_seconds={"sql": 0.1}),
                             "tiny"))
    r.register(InFlightCollector(InFlightSeconds(), "tiny"))
    stages = [StageTiming(stage, 0, 3, 0.2, 0.1 * stage) for stage in range(2)]
    r.register(PipelineStageCollector(SimpleNamespace(stage_timings=lambda: stages), "tiny"))
    # Families with per-adapter children show only once an adapter was used.
    metrics.on_lora_request("sql")
    metrics.on_lora_tokens("sql", 1)
    metrics.on_finished("stop", 0.0, 1.0)
    return generate_latest(r).decode()


def test_the_page_lists_exactly_the_gateways_metrics():
    doc = documented_metrics()
    assert served_metrics(gateway_scrape()) == {**doc["Gateway"], **doc["Every process"]}


def test_the_page_lists_exactly_the_engine_pods_metrics():
    doc = documented_metrics()
    assert served_metrics(engine_scrape()) == {**doc["Engine pods"], **doc["Every process"]}


def test_every_row_names_its_vllm_counterpart_or_none():
    rows = [line for line in DOC.read_text().splitlines() if _ROW.match(line)]
    assert len(rows) == sum(len(s) for s in documented_metrics().values())
    for row in rows:
        vllm = row.rstrip(" |").rsplit("|", 1)[1].strip()
        assert vllm.startswith(("`vllm:", "`process_", "`python_")) or vllm == "none: Tessera-only", row
