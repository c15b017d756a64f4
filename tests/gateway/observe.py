"""What the gateway tests read off running processes: Prometheus sums, an
engine pod's in-flight count, a streamed response's chunks; and waiting
for a condition."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tessera.v1 import engine_pb2, engine_pb2_grpc
from tests.engine_pod.server.client import pod_channel


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` at a /metrics URL whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url).text.splitlines():
        sample = line.startswith(name + "{") or (not labels and line.startswith(name + " "))
        if sample and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def pod_metrics_url(pod) -> str:
    return f"http://127.0.0.1:{pod.metrics_port}/metrics"


def aborted(*pods) -> float:
    """Requests the pods finished as aborted."""
    return sum(metric_sum(pod_metrics_url(p), "tessera_request_success_total", finished_reason="abort")
               for p in pods)


def in_flight(pod) -> int:
    """Running plus waiting requests of a pod, from its own load report."""
    with pod_channel(pod.address) as channel:
        report = engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.LoadRequest())
    return report.num_running + report.num_waiting


async def sse_data(response):
    """The `data:` payloads of a streamed (SSE) response: each JSON chunk
    parsed, and the closing "[DONE]" as the string itself."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


async def until(condition, timeout: float = 10.0) -> None:
    """Wait (polling, on the running loop) until `condition()` holds; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
