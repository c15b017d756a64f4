"""P/D between simulated pods (`tessera engine --simulate`, real processes)
through a real redis-server: a prefill pod computes a prompt and saves its
blocks (MODE_PRODUCE), a decode pod loads them from the store (MODE_CONSUME)
and emits the prompt's own tokens (engine_pod/sim/tokens.py); the store's
checks refuse a tampered value as for a real pod; neither process loads torch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine_pod.server.process import SimulatedPodsProcess
from engine_pod.sim.tokens import simulated_output
from kv_store.block_hash import hash_request_tokens
from kv_store.codec import HEADER_SIZE
from tessera.text import load_eos_token_ids
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.engine_pod.server.client import greedy, load, pod_aio_channel, scrape_metrics

BLOCK = 16
SIM_ARGS = ["--max-model-len", "256", "--num-gpu-blocks", "64", "--drain-timeout", "5"]


@pytest.fixture(scope="module")
def pd_pods(tiny_llama, fast_sim_profile, tmp_path_factory):
    from kv_store.local_redis import RedisServer

    work = tmp_path_factory.mktemp("sim-pd")
    redis = RedisServer(work)
    store = ["--kv-redis-url", redis.url]
    try:
        with SimulatedPodsProcess(tiny_llama, fast_sim_profile, 1, SIM_ARGS + store + ["--role", "prefill"],
                                  log_path=work / "prefill.log") as prefill, \
             SimulatedPodsProcess(tiny_llama, fast_sim_profile, 1, SIM_ARGS + store + ["--role", "decode"],
                                  log_path=work / "decode.log") as decode:
            prefill.wait_serving()
            decode.wait_serving()
            yield redis, prefill, decode
    finally:
        redis.stop()


def _metrics(pods: SimulatedPodsProcess) -> dict:
    return scrape_metrics(SimpleNamespace(metrics_port=pods.metrics_ports[0]))


def _pd(prefill: SimulatedPodsProcess, decode: SimulatedPodsProcess, prompt: list[int], max_tokens: int,
        tamper=None) -> tuple[list[int], list[int], int]:
    """Prefill on one pod, then (after ``tamper()``, if given) decode on the
    other: the prefill pod's token, the decode pod's tokens and its cached tokens."""

    async def run():
        async with pod_aio_channel(prefill.addresses[0]) as pch, pod_aio_channel(decode.addresses[0]) as dch:
            produce = greedy(prompt, max_tokens)
            produce.kv_transfer.mode = pb.KVTransferParams.MODE_PRODUCE
            first = [t async for resp in pb_grpc.EngineStub(pch).Generate(produce) for t in resp.token_ids]
            if tamper is not None:
                tamper()
            consume = greedy(prompt, max_tokens)
            consume.kv_transfer.mode = pb.KVTransferParams.MODE_CONSUME
            tokens, cached = [], 0
            async for resp in pb_grpc.EngineStub(dch).Generate(consume):
                tokens += resp.token_ids
                cached = max(cached, resp.num_cached_tokens)
            return first, tokens, cached

    return asyncio.run(run())


def _redis_key(redis, block_hash: bytes) -> bytes:
    """The one key of the simulated pods' namespace that holds this block."""
    keys = [k for k in redis.client.keys("tessera:*") if k.endswith(block_hash.hex().encode())]
    assert len(keys) == 1, keys
    return keys[0]


def test_the_decode_pod_loads_the_prefill_pods_blocks(pd_pods, tiny_llama):
    redis, prefill, decode = pd_pods
    prompt = list(range(500, 600))  # six full blocks stored, four tokens computed by the decode pod
    before_p, before_d = _metrics(prefill), _metrics(decode)
    first, tokens, cached = _pd(prefill, decode, prompt, 8)
    after_p, after_d = _metrics(prefill), _metrics(decode)
    expected = simulated_output(prompt, 8, 8192, load_eos_token_ids(tiny_llama))
    assert first == expected[:1] and tokens == expected
    assert cached == 6 * BLOCK

    def grew(before, after, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    value_bytes = len(redis.client.get(_redis_key(redis, hash_request_tokens(prompt, BLOCK)[0])))
    assert value_bytes == HEADER_SIZE + 2 * 4 * 2 * 64 * BLOCK * 4  # tiny: 4 layers, 2 KV heads of 64, float32
    assert grew(before_p, after_p, "tessera_kv_store_written_bytes_total", tier="redis") == 6 * value_bytes
    assert grew(before_d, after_d, "tessera_kv_store_hits_total", tier="redis") == 6
    assert grew(before_d, after_d, "tessera_kv_store_read_bytes_total", tier="redis") == 6 * value_bytes
    assert grew(before_d, after_d, "tessera_kv_store_rejected_values_total", tier="redis", reason="mac") == 0
    # The decode pod's prefix cache now holds the prompt's blocks, and its load reports say so.
    assert load(decode.addresses[0], hash_request_tokens(prompt, BLOCK)).matched_prefix_blocks == 6


def test_a_tampered_stored_value_is_refused_and_recomputed(pd_pods, tiny_llama):
    redis, prefill, decode = pd_pods
    prompt = list(range(700, 790))  # five full blocks stored
    key = None

    def tamper():
        nonlocal key
        key = _redis_key(redis, hash_request_tokens(prompt, BLOCK)[0])
        value = bytearray(redis.client.get(key))
        value[HEADER_SIZE + 100] ^= 0x40
        redis.client.set(key, bytes(value))

    before = _metrics(decode)
    first, tokens, cached = _pd(prefill, decode, prompt, 5, tamper=tamper)
    after = _metrics(decode)
    assert tokens == simulated_output(prompt, 5, 8192, load_eos_token_ids(tiny_llama))
    assert cached == 0  # the run of blocks stops at the first, refused one
    rejected = ("tessera_kv_store_rejected_values_total", (("reason", "mac"), ("tier", "redis")))
    assert after[rejected] - before[rejected] == 1
    hits = ("tessera_kv_store_hits_total", (("tier", "redis"),))
    assert after[hits] == before[hits]


def test_neither_simulated_process_loads_torch(pd_pods):
    _, prefill, decode = pd_pods
    for pods in (prefill, decode):
        assert "libtorch" not in Path(f"/proc/{pods.proc.pid}/maps").read_text()
