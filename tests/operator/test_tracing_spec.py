"""spec.tracing: the operator renders it as the standard OTEL_* variables of the gateway's and the
engine pods' containers (which tessera/tracing.py and the SDK read), and refuses bad values with
a message naming the field."""

from __future__ import annotations

import pytest

from tessera.tracing import ENGINE_SERVICE_NAME, GATEWAY_SERVICE_NAME, build_tracer_provider
from tessera_operator.reconcile import desired_objects
from tessera_operator.validation import InvalidInferenceService, validate_inference_service

from .conftest import make_isvc

ENDPOINT = "http://otel-collector.observability:4317"


def _env_by_container(body: dict) -> dict[str, dict[str, str]]:
    """Deployment name -> its main container's plain env values."""
    out = {}
    for obj in desired_objects(validate_inference_service(body), operator_namespace="tessera-system"):
        if obj["kind"] == "Deployment":
            container = obj["spec"]["template"]["spec"]["containers"][0]
            out[obj["metadata"]["name"]] = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return out


@pytest.mark.parametrize("mode", ["mixed", "disaggregated"])
def test_spec_tracing_becomes_the_otel_variables_of_every_component(mode):
    envs = _env_by_container(make_isvc({"mode": mode, "tracing": {"endpoint": ENDPOINT, "samplingRatio": 0.25}}))
    assert len(envs) == (3 if mode == "disaggregated" else 2)  # the gateway and each pool
    for name, env in envs.items():
        service = GATEWAY_SERVICE_NAME if name.endswith("-gateway") else ENGINE_SERVICE_NAME
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == ENDPOINT, name
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio", name
        assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.25", name
        assert env["OTEL_SERVICE_NAME"] == service, name


def test_sampling_ratio_defaults_to_every_trace():
    envs = _env_by_container(make_isvc({"tracing": {"endpoint": ENDPOINT}}))
    assert {env["OTEL_TRACES_SAMPLER_ARG"] for env in envs.values()} == {"1.0"}


def test_without_spec_tracing_no_component_traces():
    for env in _env_by_container(make_isvc()).values():
        assert not [name for name in env if name.startswith("OTEL_")]


@pytest.mark.parametrize("tracing, message", [
    ({"endpoint": ENDPOINT, "samplingRatio": 1.5}, "spec.tracing.samplingRatio: must be <= 1"),
    ({"endpoint": ENDPOINT, "samplingRatio": -0.1}, "spec.tracing.samplingRatio: must be >= 0"),
    ({"endpoint": ENDPOINT, "samplingRatio": "half"}, "spec.tracing.samplingRatio: must be a number"),
    ({"endpoint": "otel-collector:4317"}, "spec.tracing: tracing.endpoint must be an OTLP/gRPC URL"),
    ({"endpoint": "http://otel-collector:4318/v1/traces"}, "spec.tracing: tracing.endpoint must be an OTLP/gRPC"),
    ({"samplingRatio": 0.5}, "spec.tracing.endpoint: required"),
    ({"endpoint": ENDPOINT, "ratio": 0.5}, "spec.tracing.ratio: unknown field"),
])
def test_bad_tracing_values_are_refused_with_the_field(tracing, message):
    with pytest.raises(InvalidInferenceService) as info:
        validate_inference_service(make_isvc({"tracing": tracing}))
    assert message in str(info.value)


def test_the_rendered_variables_configure_the_sdk_sampler(monkeypatch):
    """What the operator sets is what the SDK reads: tessera/tracing.py leaves the sampler to it."""
    env = _env_by_container(make_isvc({"tracing": {"endpoint": ENDPOINT, "samplingRatio": 0.25}}))["llama-gateway"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    provider = build_tracer_provider("ignored")
    try:
        assert provider is not None
        assert provider.resource.attributes["service.name"] == GATEWAY_SERVICE_NAME
        assert provider.sampler.get_description() == "ParentBased{root:TraceIdRatioBased{0.25}," \
            "remoteParentSampled:AlwaysOnSampler,remoteParentNotSampled:AlwaysOffSampler," \
            "localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler}"
    finally:
        provider.shutdown()
