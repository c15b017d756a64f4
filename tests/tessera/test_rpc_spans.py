"""gRPC spans by the RPC semantic conventions (tessera/tracing.py): attributes, status code, and
which codes make a span ERROR on each side of a call."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tessera.tracing import end_rpc_span, start_rpc_span


@pytest.fixture
def tracer_and_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


@pytest.mark.parametrize("kind, code, failed, error", [
    (SpanKind.SERVER, grpc.StatusCode.OK, None, False),
    (SpanKind.SERVER, grpc.StatusCode.INTERNAL, None, True),
    (SpanKind.SERVER, grpc.StatusCode.UNAVAILABLE, None, True),
    # The caller's mistake is no failure of the server that refused it.
    (SpanKind.SERVER, grpc.StatusCode.INVALID_ARGUMENT, None, False),
    (SpanKind.SERVER, grpc.StatusCode.RESOURCE_EXHAUSTED, None, False),
    (SpanKind.CLIENT, grpc.StatusCode.OK, None, False),
    (SpanKind.CLIENT, grpc.StatusCode.INVALID_ARGUMENT, None, True),
    (SpanKind.CLIENT, grpc.StatusCode.CANCELLED, None, True),
    # A caller that cancelled on purpose says so.
    (SpanKind.CLIENT, grpc.StatusCode.CANCELLED, False, False),
])
def test_status_code_and_error(tracer_and_spans, kind, code, failed, error):
    tracer, exporter = tracer_and_spans
    span = start_rpc_span(tracer, "tessera.v1.Engine/Generate", kind)
    end_rpc_span(span, code, "why", failed=failed)
    (done,) = exporter.get_finished_spans()
    assert done.name == "tessera.v1.Engine/Generate" and done.kind == kind
    assert dict(done.attributes) == {"rpc.system": "grpc", "rpc.service": "tessera.v1.Engine", "rpc.method": "Generate",
                                     "rpc.grpc.status_code": code.value[0]}
    assert (done.status.status_code == StatusCode.ERROR) == error
    if error:
        assert done.status.description == "why"
