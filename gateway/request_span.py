"""The GenAI semantic conventions on a request's SERVER span (FastAPI's for
REST, gateway/grpc_service.py's for gRPC): what was asked for, events for
the pipeline's decisions, and what the request answered (finish reasons,
token usage over all its choices). Each engine call's own answer is on its
CLIENT span too (gateway/engine_call.py)."""

from __future__ import annotations

from opentelemetry import trace

from gateway.request import GenerationRequest
from tessera.tracing import (
    GEN_AI_OPERATION_NAME,
    GEN_AI_REQUEST_MAX_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_REQUEST_TEMPERATURE,
    GEN_AI_REQUEST_TOP_P,
    GEN_AI_RESPONSE_FINISH_REASONS,
    GEN_AI_RESPONSE_ID,
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
)


def record_request(span: trace.Span, req: GenerationRequest) -> None:
    """The request's GenAI attributes; gen_ai.response.id is the request id
    (the hex part of REST's "cmpl-..." / "chatcmpl-..." ids, gRPC's `id`)."""
    options = req.options
    span.set_attributes({
        GEN_AI_OPERATION_NAME: "chat" if req.messages is not None else "text_completion",
        GEN_AI_REQUEST_MODEL: req.model,
        GEN_AI_REQUEST_TEMPERATURE: options.temperature,
        GEN_AI_REQUEST_TOP_P: options.top_p,
        GEN_AI_RESPONSE_ID: req.request_id,
    })
    if options.max_tokens is not None:
        span.set_attribute(GEN_AI_REQUEST_MAX_TOKENS, options.max_tokens)


def record_admitted(span: trace.Span, queue_wait_s: float, priority_class: str) -> None:
    """Event: admission let the request through after `queue_wait_s` in the fair queue."""
    span.add_event("admitted", {"tessera.queue_wait_seconds": queue_wait_s,
                                "tessera.priority_class": priority_class})


def record_routed(span: trace.Span, pod: str, cached_tokens: int, disaggregated: bool) -> None:
    """Event: the router chose `pod`, which reported `cached_tokens` of the prompt cached."""
    span.add_event("routed", {"tessera.pod": pod, "tessera.cached_tokens": cached_tokens,
                              "tessera.disaggregated": disaggregated})


def record_response(span: trace.Span, finish_reasons: list[str], input_tokens: int, output_tokens: int) -> None:
    """What the request answered, once it ended: each choice's finish reason (those that
    finished) and the token usage. Nothing on a span that already ended."""
    if not span.is_recording():
        return
    if finish_reasons:
        span.set_attribute(GEN_AI_RESPONSE_FINISH_REASONS, finish_reasons)
    span.set_attributes({GEN_AI_USAGE_INPUT_TOKENS: input_tokens, GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens})
