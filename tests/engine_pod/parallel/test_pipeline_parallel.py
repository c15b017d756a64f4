"""Pipeline parallelism end to end (real worker processes, gloo on CPU):
greedy tokens equal Hugging Face's at PP=2 and PP=2 x TP=2 for Llama and
Qwen2, with chunked prefill, prefix caching and preemption in the same run;
speculative decoding and structured output under PP; a killed stage fails
the engine fast and leaves no process behind.

Float64, as in the other parity tests, so a different summation order cannot
flip a near-tied greedy choice.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from engine_pod import LLM, SamplingParams
from engine_pod.executor.multiproc import WorkerError
from tests.engine_pod.hf_reference import assert_matches_hf, hf_greedy
from tests.engine_pod.test_tensor_parallel_faults import _alive, _wait_gone

# Worker processes: end to end, like the tensor-parallel tests.
pytestmark = pytest.mark.slow

BLOCK = 16


def _prompts() -> list[list[int]]:
    """Six prompts of 20-90 tokens; four share a 40-token prefix (prefix caching hits)."""
    rng = random.Random(7)
    prefix = [rng.randrange(5, 6000) for _ in range(40)]
    lengths = [90, 20, 70, 55, 85, 33]
    prompts = []
    for i, n in enumerate(lengths):
        head = prefix if i % 3 != 1 else []
        prompts.append(head + [rng.randrange(5, 6000) for _ in range(n - len(head))])
    return prompts


PROMPTS = _prompts()
MAX_TOKENS = [24, 16, 20, 12, 24, 16]
# A 32-token budget chunks every prompt; 12 blocks of 16 (192 slots) hold one
# request's 90 + 24 tokens but not all six at once, so requests are preempted.
ENGINE_KW = dict(
    dtype="float64", max_model_len=128, block_size=BLOCK, device="cpu", enable_prefix_caching=True,
    max_num_batched_tokens=32, num_gpu_blocks=12,
)


@pytest.fixture(scope="module")
def hf_reference(tiny_llama, tiny_qwen2):
    return {"tiny_llama": hf_greedy(tiny_llama, PROMPTS, MAX_TOKENS),
            "tiny_qwen2": hf_greedy(tiny_qwen2, PROMPTS, MAX_TOKENS)}


@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2)], ids=["pp2", "pp2xtp2"])
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
def test_greedy_equals_hf_chunked_cached_and_preempted(request, hf_reference, family, pp, tp):
    path = request.getfixturevalue(family)
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=0) for n in MAX_TOKENS]
    with LLM(str(path), pipeline_parallel_size=pp, tensor_parallel_size=tp, **ENGINE_KW) as llm:
        executor = llm.engine_core.executor
        assert len(executor.worker_pids) == pp * tp
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        stats = llm.stats
        # Each stage caches its 2 of the 4 layers: a block takes half the bytes of the whole model's.
        per_rank = executor.collective_rpc("bytes_per_block")
        whole = 2 * 4 * BLOCK * (2 // tp) * 64 * 8  # K and V, layers, slots, this rank's KV heads, head dim, f64
    assert_matches_hf(outputs, hf_reference[family], PROMPTS, logprob_tol=1e-6)
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.steps > sum(len(p) for p in PROMPTS) // 32  # prompts were chunked
    assert stats.max_steps_in_flight == pp  # the stages worked on different steps at once
    assert per_rank == [whole // 2] * (pp * tp)


def test_speculative_decoding_under_pp2xtp2_equals_hf(tiny_llama):
    # Prompts that repeat a phrase, so n-gram drafts get accepted.
    rng = random.Random(3)
    prompts = []
    for _ in range(3):
        phrase = [rng.randrange(5, 6000) for _ in range(rng.randrange(3, 7))]
        prompts.append([rng.randrange(5, 6000) for _ in range(20)] + phrase * 4)
    max_tokens = [32, 24, 32]
    reference = hf_greedy(tiny_llama, prompts, max_tokens)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    kw = dict(ENGINE_KW, num_gpu_blocks=None, kv_cache_memory_bytes=16 << 20)
    with LLM(str(tiny_llama), pipeline_parallel_size=2, tensor_parallel_size=2, speculative_config=spec,
             **kw) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens])
        stats = llm.stats
    assert [o.outputs[0].token_ids for o in outputs] == [r.token_ids for r in reference]
    assert stats.spec_decode.num_drafts > 0 and stats.spec_decode.num_accepted_tokens > 0


def test_structured_output_under_pp2_equals_one_stage(tiny_llama):
    from tessera.structured_output import StructuredOutputsParams

    regex = r"[a-z]{2,6}( [a-z]{2,6}){0,3}\."
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex))
    prompts = ["The quick brown fox", "Pipeline stages take turns"]
    kw = dict(ENGINE_KW, num_gpu_blocks=None, kv_cache_memory_bytes=16 << 20)
    with LLM(str(tiny_llama), **kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(str(tiny_llama), pipeline_parallel_size=2, **kw) as llm:
        got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in got] == want
    assert all(o.finish_reason == "stop" for o in got)


@pytest.mark.parametrize("rank", [0, 1], ids=["first-stage", "last-stage"])
def test_killing_a_stage_fails_generate_fast_and_leaves_no_process(tiny_llama, rank):
    """Rank 0 is stage 0: the last stage (rank 1, which samples and answers
    the executor) is then blocked receiving from it. Rank 1 is the sampler:
    the executor then waits for its reply (and stage 0 to send it the next step)."""
    kw = dict(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=32 << 20, device="cpu")
    llm = LLM(str(tiny_llama), pipeline_parallel_size=2, **kw)
    pids = llm.engine_core.executor.worker_pids
    killed_at: list[float] = []

    def kill_once_decoding():
        while llm.stats.steps < 20:
            time.sleep(0.01)
        killed_at.append(time.monotonic())
        os.kill(pids[rank], signal.SIGKILL)

    killer = threading.Thread(target=kill_once_decoding, daemon=True)
    killer.start()
    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    death = rf"pipeline-parallel worker rank {rank} \(pid \d+, stage {rank}\) was killed by signal 9"
    with pytest.raises(WorkerError, match=death):
        llm.generate([f"prompt number {i}" for i in range(8)], params)
    assert time.monotonic() - killed_at[0] < 10.0
    killer.join()
    assert _wait_gone(pids, 2.0) == []
    with pytest.raises(WorkerError, match=f"rank {rank}"):
        llm.generate(["again"], SamplingParams(max_tokens=2))
    llm.shutdown()
    assert not any(_alive(p) for p in pids)
