"""OpenTelemetry tracing shared by engine pods and the gateway: the set-up,
the W3C context on gRPC metadata, and the gRPC spans of the RPC semantic
conventions.

The exporter follows the standard variables: OTEL_TRACES_EXPORTER ("otlp",
"console" or "none") and OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT. One deviation
from the SDK's defaults: with neither variable set, tracing is off, so a pod
without a collector does not log connection errors forever. The sampler is
the SDK's, from OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (default
parentbased_always_on).
"""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
# Each component's service.name (OTEL_SERVICE_NAME overrides it; the operator sets these).
GATEWAY_SERVICE_NAME = "tessera-gateway"
ENGINE_SERVICE_NAME = "tessera-engine"


def _exporter_name() -> str:
    name = os.environ.get("OTEL_TRACES_EXPORTER")
    if name:
        return name.split(",")[0].strip().lower()
    endpoint_set = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return "otlp" if endpoint_set else "none"


def configure_tracing(service_name: str) -> TracerProvider | None:
    """Install a tracer provider per the OTEL_* variables; None when off."""
    provider = build_tracer_provider(service_name)
    if provider is not None:
        trace.set_tracer_provider(provider)
        logger.info("tracing: exporting spans with %s", _exporter_name())
    return provider


def build_tracer_provider(service_name: str) -> TracerProvider | None:
    """The tracer provider the OTEL_* variables describe (not installed); None when off."""
    name = _exporter_name()
    if name == "none":
        return None
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter,
        )

        exporter: SpanExporter = OTLPSpanExporter()
    elif name == "console":
        exporter = ConsoleSpanExporter()
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported (otlp, console or none)")
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    # No sampler given: the SDK reads OTEL_TRACES_SAMPLER[_ARG] itself.
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class _MetadataGetter(Getter):
    """Reads W3C trace headers from gRPC invocation metadata."""

    def get(self, carrier, key):
        values = [v for k, v in carrier if k == key]
        return values or None

    def keys(self, carrier):
        return [k for k, _ in carrier]


def parent_context(metadata) -> object:
    """The caller's trace context from `traceparent` / `tracestate` metadata."""
    return _PROPAGATOR.extract(carrier=list(metadata or ()), getter=_MetadataGetter())


def inject_metadata(metadata: list[tuple[str, str]], span: trace.Span | None = None) -> list[tuple[str, str]]:
    """A span's context (default: the current one) as `traceparent` /
    `tracestate` gRPC metadata."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return metadata + list(carrier.items())


def tracer(name: str = "tessera.engine_pod") -> trace.Tracer:
    return trace.get_tracer(name)


# The GenAI semantic conventions' attribute names, as the gateway and the
# engine pod set them.
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" or "text_completion"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"  # a string array
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

# Server-side codes that are the server's failure (the RPC conventions): a
# refusal of the caller's request (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)
# is not an error of the span that refused it. On the client every non-OK
# code is.
_SERVER_FAILURES = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
})


def start_rpc_span(tracer_: trace.Tracer, full_method: str, kind: SpanKind, context=None) -> trace.Span:
    """A span for one gRPC call by the RPC semantic conventions, named
    `full_method` ("tessera.v1.Engine/Generate"); CLIENT on the caller's side,
    SERVER (under `context`, the caller's) on the callee's. Not made current:
    the callers choose whether they can detach it where they attach it."""
    service, method = full_method.rsplit("/", 1)
    return tracer_.start_span(full_method, context=context, kind=kind, attributes={
        "rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
    })


def end_rpc_span(span: trace.Span, code: grpc.StatusCode, details: str = "", failed: bool | None = None) -> None:
    """Record the call's status code, mark a failure ERROR and end the span.
    `failed`: whether the call failed, when the caller knows better than the
    conventions (by default: _SERVER_FAILURES on a server, any code but OK
    on a client)."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if failed is None:
        server = getattr(span, "kind", None) == SpanKind.SERVER  # a non-recording span has no kind
        failed = code in _SERVER_FAILURES if server else code != grpc.StatusCode.OK
    if failed:
        span.set_status(Status(StatusCode.ERROR, details or code.name))
    span.end()


def server_call_code(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status a gRPC server handler ended its call with: what it aborted
    with, CANCELLED when the caller went away, UNKNOWN for an exception grpc
    turns into one, else what it set (OK by default)."""
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    if error is not None and not isinstance(error, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN
    return _as_status_code(context.code())


def _as_status_code(code) -> grpc.StatusCode:
    """grpc.aio's context.code(): a StatusCode, its int, or None (never set)."""
    if isinstance(code, grpc.StatusCode):
        return code
    if code is None:
        return grpc.StatusCode.OK
    return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
