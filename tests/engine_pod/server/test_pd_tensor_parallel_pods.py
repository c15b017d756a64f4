"""P/D between real pod processes of different TP degrees, through Redis and
through the direct channel: a prefill pod at TP=2 feeding a decode pod at
TP=1, TP=1 feeding TP=2, and TP=2 feeding TP=2. The store moves whole
blocks (every KV head; engine_pod/worker/kv_shards.py), so each side's ranks
take their own heads whatever the other side's degree.

Hugging Face Transformers is the oracle: the decode pod's greedy tokens and
their logprobs (float64) equal HF's, and it loaded every full block of the
prompt (a wrong head moves the logprobs even where a token survives).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from engine_pod.server.process import EnginePodProcess, free_port
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.engine_pod.hf_reference import hf_greedy
from tests.engine_pod.server.client import greedy, pod_aio_channel, scrape_metrics

BLOCK = 16
MAX_TOKENS = 6
LOGPROB_TOL = 1e-6
POD_ARGS = ["--dtype", "float64", "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20)]


@pytest.fixture(scope="module")
def tp_pods(tiny_llama, tmp_path_factory):
    """Prefill pods at TP=1 and TP=2, decode pods at TP=1 and TP=2 (with inboxes: TP=1's takes pushes over
    gRPC, TP=2's over its inbox socket), one Redis."""
    from kv_store.local_redis import RedisServer

    work = tmp_path_factory.mktemp("pd-tp")
    redis = RedisServer(work)
    store = ["--kv-redis-url", redis.url]

    def pod(name, role, tp, extra=()):
        args = [*POD_ARGS, *store, "--role", role, "--tensor-parallel-size", str(tp), "--cpu-threads", str(tp),
                *extra]
        return EnginePodProcess(tiny_llama, args, log_path=work / f"{name}.log")

    try:
        with pod("prefill-tp1", "prefill", 1) as p1, pod("prefill-tp2", "prefill", 2) as p2, \
             pod("decode-tp1", "decode", 1, ["--kv-inbox-bytes", str(32 << 20)]) as d1, \
             pod("decode-tp2", "decode", 2, ["--kv-inbox-bytes", str(32 << 20),
                                             "--kv-inbox-port", str(free_port())]) as d2:
            for p in (p1, p2, d1, d2):
                p.wait_serving(timeout=180)
            yield {"prefill": {1: p1, 2: p2}, "decode": {1: d1, 2: d2}}
    finally:
        redis.stop()


async def _pd(prefill: str, decode: str, prompt: list[int], direct: bool) -> tuple[list[int], list[float], int]:
    """Produce on one pod, consume on the other: the decode pod's tokens, their logprobs, its cached tokens."""
    async with pod_aio_channel(prefill) as pch, pod_aio_channel(decode) as dch:
        produce = greedy(prompt, MAX_TOKENS)
        produce.kv_transfer.mode = pb.KVTransferParams.MODE_PRODUCE
        if direct:
            produce.kv_transfer.direct_target = decode
        async for _ in pb_grpc.EngineStub(pch).Generate(produce, timeout=120):
            pass
        consume = greedy(prompt, MAX_TOKENS, logprobs=0)
        consume.kv_transfer.mode = pb.KVTransferParams.MODE_CONSUME
        tokens, logprobs, cached = [], [], 0
        async for resp in pb_grpc.EngineStub(dch).Generate(consume, timeout=120):
            tokens += resp.token_ids
            logprobs += [lp.entries[0].logprob for lp in resp.logprobs]
            cached = max(cached, resp.num_cached_tokens)
        return tokens, logprobs, cached


LAYOUTS = [(2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("channel", ["redis", "direct"])
def test_pd_across_tp_degrees_equals_hugging_face(tp_pods, tiny_llama, channel):
    rng = random.Random(22 if channel == "redis" else 23)
    prompts = [[rng.randrange(5, 6000) for _ in range(length)] for length in (100, 150, 83)]
    expected = hf_greedy(tiny_llama, prompts, [MAX_TOKENS] * len(prompts))
    for (prefill_tp, decode_tp), prompt, ref in zip(LAYOUTS, prompts, expected):
        decode, prefill = tp_pods["decode"][decode_tp], tp_pods["prefill"][prefill_tp]
        before = scrape_metrics(prefill)
        tokens, logprobs, cached = asyncio.run(_pd(prefill.address, decode.address, prompt, channel == "direct"))
        layout = f"prefill TP={prefill_tp} -> decode TP={decode_tp} over {channel}"
        if channel == "direct":
            path = "socket" if decode_tp == 2 else "grpc"
            key = ("tessera_kv_transfer_push_paths_total", (("path", path),))
            grew = {k: v - before.get(k, 0.0) for k, v in scrape_metrics(prefill).items() if k[0] == key[0]}
            assert {k: v for k, v in grew.items() if v} == {key: 1.0}, layout
        assert tokens == ref.token_ids, layout
        assert max(abs(a - b) for a, b in zip(logprobs, ref.logprobs)) < LOGPROB_TOL, layout
        assert cached == (len(prompt) - 1) // BLOCK * BLOCK, layout
