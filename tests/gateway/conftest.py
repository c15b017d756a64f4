"""A real platform on loopback for the gateway tests: two engine pods
(`tessera engine` subprocesses on the tiny checkpoint) behind a gateway
(`tessera gateway` subprocess) with a tenants file."""

from __future__ import annotations

import pytest
import yaml

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from gateway.tenants import hash_api_key

# float64 so greedy tokens equal the offline engine's whatever the batch
# composition (see tests/engine_pod/test_hf_parity.py).
MAX_MODEL_LEN = 256
# One torch thread per pod: several pods share this machine's cores, and
# oversubscribed OpenMP threads slow every pod down many times over.
POD_ARGS = ["--dtype", "float64", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(32 << 20),
            "--cpu-threads", "1"]
MODEL_NAME = "tiny"

# API keys of the test tenants (the file stores only their hashes).
KEYS = {
    "alice": "sk-alice-0123456789",
    "bob": "sk-bob-0123456789",
    "rpm": "sk-rpm-0123456789",
    "rpm-grpc": "sk-rpm-grpc-0123456789",
    "tpm": "sk-tpm-0123456789",
    "tpm-reserve": "sk-tpm-reserve-0123456789",
    "grpc": "sk-grpc-0123456789",
    "fuzz": "sk-fuzz-0123456789",
    "docs-a": "sk-docs-a-0123456789",
    "docs-b": "sk-docs-b-0123456789",
}
TENANTS = [
    {"name": "alice"},
    {"name": "bob"},
    {"name": "rpm", "requests_per_minute": 2},
    {"name": "rpm-grpc", "requests_per_minute": 2},
    {"name": "tpm", "tokens_per_minute": 60},
    {"name": "tpm-reserve", "tokens_per_minute": 100},
    {"name": "grpc"},
    {"name": "fuzz"},
    # Two tenants that opted into one shared prefix-cache salt.
    {"name": "docs-a", "cache_salt_group": "docs"},
    {"name": "docs-b", "cache_salt_group": "docs"},
]


def write_tenants(path, tenants=TENANTS, keys=KEYS) -> str:
    entries = [{**t, "api_key_sha256": [hash_api_key(keys[t["name"]])]} for t in tenants]
    path.write_text(yaml.safe_dump({"tenants": entries}))
    return str(path)


def gateway_config(model, pods, tenants_file=None, **extra) -> dict:
    config = {
        "model": {"name": MODEL_NAME, "path": str(model), "max_model_len": MAX_MODEL_LEN},
        "pods": {"static": [{"address": p.address, "role": role} for p, role in pods]},
        "router": {"load_interval_ms": 50},
        **extra,
    }
    if tenants_file:
        config["tenants_file"] = tenants_file
    return config


@pytest.fixture(scope="session")
def engine_pods(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pods")
    with EnginePodProcess(tiny_llama, POD_ARGS, log_path=logs / "a.log") as a, \
            EnginePodProcess(tiny_llama, POD_ARGS, log_path=logs / "b.log") as b:
        a.wait_serving()
        b.wait_serving()
        yield a, b


@pytest.fixture(scope="session")
def platform(tiny_llama, engine_pods, tmp_path_factory):
    """The gateway in front of both pods, with the test tenants."""
    work = tmp_path_factory.mktemp("gateway")
    tenants = write_tenants(work / "tenants.yaml")
    config = gateway_config(tiny_llama, [(p, "mixed") for p in engine_pods], tenants)
    with GatewayProcess(config, work, log_path=work / "gateway.log") as gw:
        gw.wait_ready(num_pods=2)
        yield gw


# The fuzzing gateway's context: a valid generated request stays cheap.
FUZZ_MAX_MODEL_LEN = 48


@pytest.fixture(scope="session")
def fuzz_gateway(tiny_llama, engine_pods, tmp_path_factory):
    """A gateway in front of both pods for the fuzz and property tests (its
    own process: their thousands of requests leave `platform` alone)."""
    work = tmp_path_factory.mktemp("fuzz-gateway")
    config = gateway_config(tiny_llama, [(p, "mixed") for p in engine_pods], write_tenants(work / "tenants.yaml"))
    config["model"]["max_model_len"] = FUZZ_MAX_MODEL_LEN
    with GatewayProcess(config, work, log_path=work / "gateway.log") as gw:
        gw.wait_ready(num_pods=2)
        yield gw
    assert gw.proc.returncode == 0, "the gateway did not shut down cleanly after the fuzzing"


@pytest.fixture(scope="session")
def offline_llm(tiny_llama):
    """The offline engine with the pods' settings: the oracle for greedy text."""
    from engine_pod import LLM

    return LLM(str(tiny_llama), dtype="float64", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=32 << 20)


def client(gw, tenant: str = "alice", **kwargs):
    import openai

    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=KEYS[tenant], max_retries=0, **kwargs)
