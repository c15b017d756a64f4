"""An engine pod (`tessera engine`, a real subprocess on loopback) for the tests."""

from __future__ import annotations

import pytest

from engine_pod.server.process import EnginePodProcess

# float64 so greedy tokens can be compared with the offline engine exactly
# whatever the batch composition (see tests/engine_pod/test_hf_parity.py).
POD_ARGS = ["--dtype", "float64", "--max-model-len", "256", "--kv-cache-memory-bytes", str(32 << 20)]


@pytest.fixture(scope="module")
def pod(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("pod") / "pod.log"
    with EnginePodProcess(tiny_llama, POD_ARGS, log_path=log) as p:
        p.wait_serving()
        yield p
