"""`pods.file`: the pods come from a YAML file read again whenever it
changes. A pod that leaves the file gets no new request, and what it runs
finishes instead of being cut (scale-down drains); a broken or missing file
keeps the pods as they are. Simulated pods serve."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
import yaml

from engine_pod.server.process import SimulatedPodsProcess
from engine_pod.sim.tokens import simulated_output
from gateway.pods.discovery import members_from_file
from gateway.process import GatewayProcess
from tessera.text import load_eos_token_ids
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.conftest import KEYS, MAX_MODEL_LEN, MODEL_NAME, write_tenants
from tests.gateway.observe import metric_sum

PROFILE = "engine_pod/sim/profiles/bench-cpu.json"
AUTH = (("authorization", f"Bearer {KEYS['alice']}"),)


def test_the_file_lists_pods_by_role():
    assert members_from_file("mixed: [b:1, a:1, a:1]\ndecode: []\n") == {"mixed": ["a:1", "b:1"], "decode": []}
    assert members_from_file("") == {}
    for text, message in [("[a:1]", "mapping of roles"), ("mixd: [a:1]", "role 'mixd'"),
                          ("mixed: a:1", "list of host:port"), ("mixed: [nohost]", "list of host:port")]:
        with pytest.raises(ValueError, match=message):
            members_from_file(text)


def _write(path, addresses: list[str]) -> None:
    """Atomically, as the watcher asks (a rename never shows a half-written file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"mixed": addresses}))
    os.replace(tmp, path)


async def _stream(stub, prompt, max_tokens, on_first=None):
    tokens, error = [], None
    params = pb.GenerationParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        async for chunk in stub.Complete(pb.CompletionRequest(model=MODEL_NAME, prompt_token_ids=prompt,
                                                              params=params), metadata=AUTH, timeout=60):
            for choice in chunk.choices:
                tokens.extend(choice.token_ids)
            if tokens and on_first is not None:
                on_first()
                on_first = None
    except grpc.aio.AioRpcError as e:
        error = e.code()
    return tokens, error


def test_a_pod_leaving_the_file_drains_and_new_requests_go_elsewhere(tiny_llama, tmp_path):
    eos = load_eos_token_ids(tiny_llama)
    members = tmp_path / "pods.yaml"
    with SimulatedPodsProcess(tiny_llama, PROFILE, 2, ["--max-model-len", str(MAX_MODEL_LEN)],
                              log_path=tmp_path / "pods.log") as pods:
        pods.wait_serving()
        first, second = pods.addresses
        _write(members, [first])
        config = {"model": {"name": MODEL_NAME, "path": str(tiny_llama), "max_model_len": MAX_MODEL_LEN},
                  "pods": {"file": {"path": str(members), "poll_interval_s": 0.1}},
                  "router": {"load_interval_ms": 50}, "tenants_file": write_tenants(tmp_path / "tenants.yaml")}
        with GatewayProcess(config, tmp_path, log_path=tmp_path / "gateway.log") as gw:
            gw.wait_ready(num_pods=1)

            def routed(address):
                return metric_sum(gw.metrics_url, "tessera_gateway_routing_decisions_total", pod=address)

            async def run():
                async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
                    stub = pb_grpc.InferenceStub(channel)
                    long = asyncio.create_task(_stream(stub, [1, 2, 3, 4], 30, on_first=lambda: _write(members,
                                                                                                     [second])))
                    deadline = time.monotonic() + 10
                    while routed(second) == 0 and time.monotonic() < deadline:
                        # New requests go to the second pod once the gateway has read the file.
                        await _stream(stub, [9, 9, 9], 1)
                    routed_first = routed(first)
                    later = await asyncio.gather(*(_stream(stub, [50 + i] * 5, 3) for i in range(4)))
                    # A broken file, then none: the pods stay as they are.
                    members.write_text("mixed: [unclosed")
                    await asyncio.sleep(0.5)
                    broken = await _stream(stub, [7, 7], 2)
                    members.unlink()
                    await asyncio.sleep(0.5)
                    missing = await _stream(stub, [8, 8], 2)
                    return await long, later, broken, missing, routed_first

            (long_tokens, long_error), later, broken, missing, first_before = asyncio.run(run())
            first_after = routed(first)
    assert long_error is None and long_tokens == simulated_output([1, 2, 3, 4], 30, 8192, eos)  # not cut
    assert all(error is None for _, error in later)
    assert first_after == first_before  # once the file was read, nothing new went to the pod that left
    assert broken == (simulated_output([7, 7], 2, 8192, eos), None)
    assert missing == (simulated_output([8, 8], 2, 8192, eos), None)
