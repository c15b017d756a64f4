"""P/D between real pod processes where one side runs pipeline parallelism:
a prefill pod at PP=2 feeding a decode pod at TP=1, and a prefill pod at
TP=1 feeding a decode pod at PP=2, through Redis and through the direct
channel (each decode pod takes pushes over its inbox socket). The store
moves whole blocks, each stage taking its own layers
(engine_pod/worker/kv_shards.py).

Hugging Face Transformers is the oracle, as in test_pd_tensor_parallel_pods.py
(whose P/D client this uses): greedy tokens and their float64 logprobs, and
every full block of the prompt loaded.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from engine_pod.server.process import EnginePodProcess, free_port
from tests.engine_pod.hf_reference import hf_greedy
from tests.engine_pod.server.client import scrape_metrics
from tests.engine_pod.server.test_pd_tensor_parallel_pods import BLOCK, LOGPROB_TOL, MAX_TOKENS, POD_ARGS, _pd

pytestmark = pytest.mark.slow  # worker processes


@pytest.fixture(scope="module")
def pp_pods(tiny_llama, tmp_path_factory):
    from kv_store.local_redis import RedisServer

    work = tmp_path_factory.mktemp("pd-pp")
    redis = RedisServer(work)

    def pod(name, role, pp, extra=()):
        args = [*POD_ARGS, "--kv-redis-url", redis.url, "--role", role, "--pipeline-parallel-size", str(pp),
                "--cpu-threads", str(pp), *extra]
        return EnginePodProcess(tiny_llama, args, log_path=work / f"{name}.log")

    def inbox():
        return ["--kv-inbox-bytes", str(32 << 20), "--kv-inbox-port", str(free_port())]

    try:
        with pod("prefill-pp2", "prefill", 2) as p2, pod("prefill-pp1", "prefill", 1) as p1, \
             pod("decode-pp1", "decode", 1, inbox()) as d1, pod("decode-pp2", "decode", 2, inbox()) as d2:
            for p in (p1, p2, d1, d2):
                p.wait_serving(timeout=180)
            yield {"prefill": {1: p1, 2: p2}, "decode": {1: d1, 2: d2}}
    finally:
        redis.stop()


@pytest.mark.parametrize("channel", ["redis", "direct"])
def test_pd_with_a_pipeline_parallel_side_equals_hugging_face(pp_pods, tiny_llama, channel):
    rng = random.Random(32 if channel == "redis" else 33)
    prompts = [[rng.randrange(5, 6000) for _ in range(length)] for length in (120, 77)]
    expected = hf_greedy(tiny_llama, prompts, [MAX_TOKENS] * len(prompts))
    for (prefill_pp, decode_pp), prompt, ref in zip([(2, 1), (1, 2)], prompts, expected):
        decode, prefill = pp_pods["decode"][decode_pp], pp_pods["prefill"][prefill_pp]
        before = scrape_metrics(prefill)
        tokens, logprobs, cached = asyncio.run(_pd(prefill.address, decode.address, prompt, channel == "direct"))
        layout = f"prefill PP={prefill_pp} -> decode PP={decode_pp} over {channel}"
        if channel == "direct":
            key = ("tessera_kv_transfer_push_paths_total", (("path", "socket"),))
            assert scrape_metrics(prefill)[key] - before.get(key, 0.0) == 1.0, layout
        assert tokens == ref.token_ids, layout
        assert max(abs(a - b) for a, b in zip(logprobs, ref.logprobs)) < LOGPROB_TOL, layout
        assert cached == (len(prompt) - 1) // BLOCK * BLOCK, layout
