"""The engine flags take their defaults from the config dataclasses' fields
(engine_pod/config.py): no flag repeats a literal that could drift from the
field it sets."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from engine_pod.config import (
    CacheConfig,
    EngineConfig,
    KVStoreConfig,
    NodeLayout,
    ParallelConfig,
    SchedulerConfig,
    SchedulingPolicy,
    create_engine_config,
)
from engine_pod.entrypoints.cli_args import add_engine_args, engine_kwargs
from engine_pod.lora.config import LoRAConfig
from kv_store.block_hash import DEFAULT_BLOCK_SIZE
from kv_store.redis_tier import REDIS_URL_ENV

# engine_kwargs' key -> the dataclass field its value lands in.
FIELD_OF_KWARG = {
    "block_size": (CacheConfig, "block_size"),
    "enable_prefix_caching": (CacheConfig, "enable_prefix_caching"),
    "num_gpu_blocks": (CacheConfig, "num_gpu_blocks"),
    "kv_cache_memory_bytes": (CacheConfig, "kv_cache_memory_bytes"),
    "gpu_memory_utilization": (CacheConfig, "gpu_memory_utilization"),
    "max_num_batched_tokens": (SchedulerConfig, "max_num_batched_tokens"),
    "max_num_seqs": (SchedulerConfig, "max_num_seqs"),
    "long_prefill_token_threshold": (SchedulerConfig, "long_prefill_token_threshold"),
    "scheduling_policy": (SchedulerConfig, "policy"),
    "background_priority": (SchedulerConfig, "background_priority"),
    "background_max_batched_tokens": (SchedulerConfig, "background_max_batched_tokens"),
    "attention_backend": (EngineConfig, "attention_backend"),
    "speculative_config": (EngineConfig, "speculative"),
    "tensor_parallel_size": (ParallelConfig, "tensor_parallel_size"),
    "pipeline_parallel_size": (ParallelConfig, "pipeline_parallel_size"),
    "kv_host_bytes": (KVStoreConfig, "host_bytes"),
    "kv_redis_url": (KVStoreConfig, "redis_url"),
    "kv_redis_ttl": (KVStoreConfig, "redis_ttl_seconds"),
    "kv_redis_cluster": (KVStoreConfig, "redis_cluster"),
    "kv_write_queue_size": (KVStoreConfig, "write_queue_size"),
    "kv_redis_key_prefix": (KVStoreConfig, "redis_key_prefix"),
    "kv_redis_ca_file": (KVStoreConfig, "redis_ca_file"),
    "kv_redis_cert_file": (KVStoreConfig, "redis_cert_file"),
    "kv_redis_key_file": (KVStoreConfig, "redis_key_file"),
    "kv_redis_timeout": (KVStoreConfig, "redis_timeout_seconds"),
    "kv_inbox_bytes": (KVStoreConfig, "inbox_bytes"),
    "kv_direct_timeout_s": (KVStoreConfig, "direct_timeout_s"),
    "max_loras": (LoRAConfig, "max_loras"),
    "max_lora_rank": (LoRAConfig, "max_lora_rank"),
    "max_cpu_loras": (LoRAConfig, "max_cpu_loras"),
}
# Off unless asked: EngineConfig.lora is None without it (no dataclass default to share).
SWITCHES = {"enable_lora"}
# Resolved by create_engine_config from the checkpoint and the machine: no field default to share.
RESOLVED_AT_BUILD = {"dtype", "device", "max_model_len"}


def field_default(cls: type, name: str) -> object:
    (field,) = [f for f in dataclasses.fields(cls) if f.name == name]
    assert field.default is not dataclasses.MISSING, f"{cls.__name__}.{name} has no default"
    return field.default


@pytest.fixture
def default_kwargs(monkeypatch) -> dict:
    """engine_kwargs of a command line that gives only the required --model."""
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_kwargs(parser.parse_args(["--model", "m"]))


def test_every_engine_flag_is_classified(default_kwargs):
    assert set(default_kwargs) == set(FIELD_OF_KWARG) | RESOLVED_AT_BUILD | SWITCHES
    assert default_kwargs["enable_lora"] is False


@pytest.mark.parametrize("kwarg", sorted(FIELD_OF_KWARG))
def test_flag_default_is_the_dataclass_default(default_kwargs, kwarg):
    cls, name = FIELD_OF_KWARG[kwarg]
    value = default_kwargs[kwarg]
    if cls is SchedulerConfig and name == "policy":
        value = SchedulingPolicy(value)
    assert value == field_default(cls, name)


def test_the_block_size_default_is_kv_stores(default_kwargs):
    assert default_kwargs["block_size"] == CacheConfig.block_size == DEFAULT_BLOCK_SIZE


def test_an_engine_built_from_the_default_flags_has_the_default_configs(default_kwargs, tiny_llama):
    kwargs = dict(default_kwargs, device="cpu")
    config = create_engine_config(tiny_llama, **kwargs)
    assert config.cache == CacheConfig()
    assert config.kv_store == KVStoreConfig()
    assert config.parallel == ParallelConfig()
    assert config.scheduler == SchedulerConfig(max_model_len=config.model.max_model_len)
    assert (config.attention_backend, config.speculative) == (EngineConfig.attention_backend, None)
    assert config.lora is None
    assert create_engine_config(tiny_llama, **dict(kwargs, enable_lora=True)).lora == LoRAConfig()


# -- the pod's own flags: where it listens ----------------------------------


def _pod_flags(*argv: str) -> argparse.Namespace:
    """`tessera engine ARGV` as the pod's parser reads it (engine_pod/server/main.py)."""
    from engine_pod.server.main import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["engine", "--model", "m", *argv])


def test_the_multi_node_flags_default_to_the_node_layouts_fields():
    """--nnodes, --node-rank, --master-addr, --master-port: pod-level flags (not
    create_engine_config's), landing in ParallelConfig.nodes with NodeLayout's defaults."""
    from engine_pod.entrypoints.cli_args import node_layout

    assert node_layout(_pod_flags()) == NodeLayout() == ParallelConfig().nodes
    layout = node_layout(_pod_flags("--nnodes", "2", "--node-rank", "1", "--master-addr", "leader.svc",
                                    "--master-port", "29600"))
    assert layout == NodeLayout(2, 1, "leader.svc", 29600)


def test_a_pod_listens_on_loopback_unless_told_otherwise():
    """The Engine API is internal: a pod started by hand is not reachable from the network."""
    assert _pod_flags().host == "127.0.0.1"
    assert _pod_flags("--host", "0.0.0.0").host == "0.0.0.0"


def test_the_operator_tells_its_pods_to_listen_on_every_interface():
    """In a cluster the gateway reaches each pod at its pod IP: the operator passes --host 0.0.0.0
    itself rather than relying on the flag's default."""
    from tessera_operator.reconcile import desired_objects
    from tests.operator.conftest import make_isvc

    (deployment,) = [o for o in desired_objects(make_isvc())
                     if (o["kind"], o["metadata"]["name"]) == ("Deployment", "llama-engine")]
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    assert container["args"][0] == "engine"
    assert _pod_flags(*container["args"][1:]).host == "0.0.0.0"


def test_the_redis_timeout_reaches_the_redis_tier():
    from tessera.internal_secret import InternalSecret

    key = InternalSecret.from_text("cli-defaults-tests-0123456789abcdef").kv_mac_key
    config = KVStoreConfig(redis_url="redis://127.0.0.1:1/0", redis_timeout_seconds=2.5, mac_key=key)
    assert config.redis_tier_config().timeout_seconds == 2.5
