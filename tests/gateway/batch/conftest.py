"""The Batch API's gateway for the end-to-end tests (test_batch_e2e.py,
test_examples.py): a real `tessera gateway` in front of the tiny model's
engine pods, files and batches in a directory, its records signed with the
key of the tests' internal secret (tests/conftest.py)."""

from __future__ import annotations

import pytest

from gateway.process import GatewayProcess
from tests.gateway.conftest import gateway_config, write_tenants

# Quick turns for the tests: a dead runner's batch is resumed within seconds.
BATCH_TIMING = {"lease_s": 2.0, "poll_interval_s": 0.2, "retry_interval_s": 0.2}


def start_batch_gateway(tiny_llama, engine_pods, work, batch: dict) -> GatewayProcess:
    config = gateway_config(tiny_llama, [(p, "mixed") for p in engine_pods], write_tenants(work / "tenants.yaml"),
                            batch={**BATCH_TIMING, **batch})
    gw = GatewayProcess(config, work, log_path=work / "gateway.log")
    gw.wait_ready(num_pods=2)
    return gw


@pytest.fixture(scope="session")
def batch_gateway(tiny_llama, engine_pods, tmp_path_factory):
    """One for the session: the examples' test and the API's share it (each gateway start costs seconds).
    `store_dir`: its store, for the tests that look behind its back."""
    work = tmp_path_factory.mktemp("batch-gateway")
    gw = start_batch_gateway(tiny_llama, engine_pods, work, {"directory": str(work / "store"),
                                                             "max_file_bytes": 200_000, "max_lines_per_file": 500})
    gw.store_dir = work / "store"
    yield gw
    gw.terminate()
