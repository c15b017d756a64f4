"""Refused requests in the metrics: each once, with a reason from a bounded set.

A refusal is an answer of 4xx, or a 503 before the request ran (no engine pod, a queue
timeout). Whoever refuses a request counts it where the labels are known: the pipeline
(gateway/serving.py: the model, the class, admission; gateway/response_stream.py: an engine
pod's refusal at submit) and the front ends for what they refuse themselves (the key, the
body, a route or method the API does not have). GatewayError.counted keeps it to once.
"""

from __future__ import annotations

from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics

# Admission's reasons (gateway/admission: the code of its 429 or 503) and the pipeline's
# own 503 before any pod ran the request: the error's code is the reason.
_CODE_REASONS = frozenset({"requests_per_minute", "tokens_per_minute", "concurrency", "shed", "queue_full",
                           "queue_timeout", "no_engine_pod"})
_STATUS_REASONS = {400: "invalid_request", 401: "unauthenticated", 403: "not_admin", 404: "not_found",
                   405: "method_not_allowed", 413: "too_large", 415: "invalid_request", 422: "invalid_request"}


def rejection_reason(e: GatewayError) -> str:
    """The `reason` label of a refusal (bounded: never the client's input)."""
    if e.code in _CODE_REASONS:
        return e.code
    if e.code == "model_not_found":
        return "model_not_found"
    return _STATUS_REASONS.get(e.status, "other")


def is_refusal(e: GatewayError) -> bool:
    """A request refused, rather than one that failed: 4xx, or the pipeline's 503s before any pod ran it."""
    return e.status < 500 or e.code in _CODE_REASONS


def count_rejection(metrics: GatewayMetrics, e: GatewayError, labels: tuple[str, str], endpoint: str) -> None:
    """Count a refused request once: tessera_gateway_rejections_total{reason} and
    tessera_gateway_requests_total{outcome="rejected"}. `labels`: (tenant, priority class),
    empty where not known yet (no valid key, no class resolved)."""
    if e.counted or not is_refusal(e):
        return
    e.counted = True
    metrics.rejections.labels(*labels, rejection_reason(e)).inc()
    metrics.requests.labels(*labels, endpoint, "rejected").inc()
