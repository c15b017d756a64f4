"""OpenTelemetry tracing set-up shared by engine pods and the gateway.

The exporter follows the standard variables: OTEL_TRACES_EXPORTER ("otlp",
"console" or "none") and OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT. One deviation
from the SDK's defaults: with neither variable set, tracing is off, so a pod
without a collector does not log connection errors forever.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()


def _exporter_name() -> str:
    name = os.environ.get("OTEL_TRACES_EXPORTER")
    if name:
        return name.split(",")[0].strip().lower()
    endpoint_set = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return "otlp" if endpoint_set else "none"


def configure_tracing(service_name: str) -> TracerProvider | None:
    """Install a tracer provider per the OTEL_* variables; None when off."""
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
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    logger.info("tracing: exporting spans with %s", name)
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
