"""Defaults that several layers repeat agree with their one home.

The block size's home is kv_store.block_hash.DEFAULT_BLOCK_SIZE: the engine caches KV in blocks
of it and the gateway hashes prompts in blocks of it, so a gateway and its pods that disagree
lose prefix affinity without an error. The CRD spells the engine's other defaults out as well
(the operator does not import the engine): an InferenceService that leaves them unset must run
`tessera engine` as it runs with no flags, and those flags must mean the engine's own defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest
import yaml

from engine_pod.config import CacheConfig, create_engine_config
from engine_pod.entrypoints.cli_args import engine_kwargs
from engine_pod.server.main import add_parser
from engine_pod.spec_decode.config import SpeculativeConfig
from gateway.config import gateway_config_from_dict
from kv_store.block_hash import DEFAULT_BLOCK_SIZE
from kv_store.redis_tier import REDIS_URL_ENV
from tessera_operator.crd import crd_manifest
from tessera_operator.reconcile import desired_objects
from tests.operator.conftest import make_isvc

MINIMAL_GATEWAY = {"model": {"name": "m", "path": "/models/m"}, "pods": {"static": [{"address": "127.0.0.1:1"}]}}
# Flags of an engine pod that are its own, not a default the CRD repeats: where it listens and
# what it is called (the operator sets them from the pod's place in the Deployment).
POD_FLAGS = frozenset({"model", "role", "host", "grpc_port", "metrics_port", "health_port", "served_model_name"})


def _engine_flags(*argv: str) -> argparse.Namespace:
    """`tessera engine ARGV` as the engine's own parser reads it."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["engine", "--model", "/models/m", *argv])


def _crd_engine_properties() -> dict:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["spec"]["properties"]["engine"]["properties"]


def _operator_object(kind: str, name: str) -> dict:
    """One object the operator makes for an InferenceService named llama that sets only its model."""
    (obj,) = [o for o in desired_objects(make_isvc()) if (o["kind"], o["metadata"]["name"]) == (kind, name)]
    return obj


def _operator_engine_args() -> list[str]:
    """The mixed pool's `tessera engine` flags (after the subcommand)."""
    (container,) = [c for c in _operator_object("Deployment", "llama-engine")["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "engine"]
    assert container["args"][0] == "engine"
    return container["args"][1:]


def _operator_gateway_config() -> dict:
    return yaml.safe_load(_operator_object("ConfigMap", "llama-gateway")["data"]["gateway.yaml"])


BLOCK_SIZE_DEFAULTS = {
    "engine CacheConfig.block_size": lambda: {f.name: f.default for f in dataclasses.fields(CacheConfig)}["block_size"],
    "engine create_engine_config(block_size=)": (
        lambda: inspect.signature(create_engine_config).parameters["block_size"].default),
    "engine --block-size": lambda: _engine_flags().block_size,
    "gateway model.block_size": lambda: gateway_config_from_dict(MINIMAL_GATEWAY).model.block_size,
    "CRD engine.blockSize": lambda: _crd_engine_properties()["blockSize"]["default"],
    "operator's gateway config model.block_size": lambda: _operator_gateway_config()["model"]["block_size"],
}


@pytest.mark.parametrize("where", list(BLOCK_SIZE_DEFAULTS))
def test_the_block_size_default_is_kv_stores(where):
    assert BLOCK_SIZE_DEFAULTS[where]() == DEFAULT_BLOCK_SIZE


def test_an_inference_service_without_engine_settings_runs_the_engine_at_its_defaults():
    """Every flag the operator derives from spec.engine (and model.dtype) parses to the value the
    engine takes when the flag is absent: a default changed on one side only fails here."""
    operator = vars(_engine_flags(*_operator_engine_args()))
    engine = vars(_engine_flags())
    differ = {name: (operator[name], engine[name]) for name in operator
              if name not in POD_FLAGS and operator[name] != engine[name]}
    # docs/configuration.md: the operator's pods sit behind the gateway, whose priority classes
    # reach them; `tessera engine` on its own schedules in arrival order.
    assert differ == {"scheduling_policy": ("priority", "fcfs")}


def test_the_engine_flags_default_to_the_engine_configs_defaults(monkeypatch):
    """`tessera engine` without flags builds the engine create_engine_config builds without arguments."""
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    parameters = inspect.signature(create_engine_config).parameters
    from_flags = engine_kwargs(_engine_flags())
    assert {name: value for name, value in from_flags.items() if value != parameters[name].default} == {}


def test_the_crd_speculative_method_default_is_the_engines():
    speculative = _crd_engine_properties()["speculative"]["properties"]
    method_default = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}["method"]
    assert speculative["method"]["default"] == method_default


def test_the_crd_redis_timeout_default_is_the_engines():
    """An InferenceService with a Redis tier and no timeoutSeconds runs its pods at the engine's own timeout."""
    resource = make_isvc({"kvStore": {"redis": {"urlSecretRef": {"name": "redis"}}}})
    (deployment,) = [o for o in desired_objects(resource) if o["kind"] == "Deployment"
                     and o["metadata"]["name"] == "llama-engine"]
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    assert _engine_flags(*container["args"][1:]).kv_redis_timeout == _engine_flags().kv_redis_timeout == 0.25
