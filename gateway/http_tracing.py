"""What the REST API traces. FastAPI makes each request's SERVER span itself
(the HTTP semantic conventions: `http.request.method`, `http.route`,
`http.response.status_code`, `url.path`; joined to the caller's W3C
`traceparent`) with the global tracer provider (tessera/tracing.py); this is
its configuration: `FastAPI(telemetry=telemetry_config())`."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from fastapi.telemetry import TelemetryConfig

# Kubelet's probes and `tessera up`'s readiness polls: a trace each would bury the requests.
PROBE_PATHS = frozenset({"/health", "/health/live", "/health/ready"})


def is_probe(scope: MutableMapping[str, Any]) -> bool:
    return scope.get("path") in PROBE_PATHS


def telemetry_config() -> TelemetryConfig:
    """Spans for every request but the probes; none for FastAPI's own steps
    (dependencies, serialization: the pipeline's spans say what took the
    time), so the pipeline's spans are the SERVER span's children. Metrics and
    logs stay Prometheus's (gateway/metrics.py) and logging's."""
    return {"exclude": is_probe, "operation_spans": False, "metrics": False, "logs": False}
