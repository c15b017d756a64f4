"""The KV store under tensor parallelism: the store holds whole blocks (every
KV head) in the engine core's process, whatever the TP degree; each rank
copies its own heads in on load, and the executor assembles every rank's
heads on save (engine_pod/worker/kv_shards.py). So engines of any TP degree
share the host tier's and Redis's values.

Hugging Face Transformers is the oracle: greedy tokens equal HF's, for
blocks served from the host tier, from Redis (written by an engine of the
same or another TP degree), with replicated KV heads, after faults, and P/D.
Float64, as in the TP parity tests (tests/engine_pod/test_tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import pickle
import random
import time

import pytest
import torch

from engine_pod import LLM, SamplingParams
from engine_pod.model.parallel_layers import kv_head_range
from engine_pod.request import Request
from engine_pod.worker.kv_shards import RankBlocks, assemble_blocks, rank_share
from kv_store.block_hash import hash_request_tokens
from tests.engine_pod.hf_reference import HFResult, assert_matches_hf, hf_greedy

BLOCK = 16
MAX_TOKENS = 8
LOGPROB_TOL = 1e-6
ENGINE_KW = dict(dtype="float64", max_model_len=512, kv_cache_memory_bytes=16 << 20, device="cpu")
# A pool of 40 blocks (a 512-token sequence takes 32): other traffic evicts a prefix from the device.
SMALL_POOL_KW = dict(ENGINE_KW, kv_cache_memory_bytes=None, num_gpu_blocks=40)


def _prompts(n: int, seed: int, lengths=(100, 200, 67)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 6000) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def _generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0))


def _check(llm: LLM, prompts: list[list[int]], reference: list[HFResult]):
    """Generate; tokens equal HF's and their logprobs too (float64: KV from a
    wrong head moves them even where the greedy token survives)."""
    outputs = _generate(llm, prompts)
    assert_matches_hf(outputs, reference, prompts, LOGPROB_TOL)
    return outputs


def _hf(path, prompts: list[list[int]]) -> list[HFResult]:
    return hf_greedy(path, prompts, [MAX_TOKENS] * len(prompts))


def _full_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK


# -- assembling and slicing (no workers) -----------------------------------
@pytest.mark.parametrize("num_kv_heads, tp", [(2, 2), (4, 2), (2, 4), (1, 2), (1, 4)])
def test_assembling_every_ranks_heads_gives_the_whole_block_back(num_kv_heads, tp):
    whole = torch.randn(3, 2, 2, BLOCK, num_kv_heads, 4, dtype=torch.float64)
    shards = []
    for rank in range(tp):
        heads = kv_head_range(num_kv_heads, tp, rank)
        shards.append(RankBlocks(heads, rank_share(whole, heads).contiguous()))
    assert assemble_blocks(shards, num_kv_heads).equal(whole)
    # Through a pickle, as a worker's reply pipe carries it.
    assert assemble_blocks(pickle.loads(pickle.dumps(shards)), num_kv_heads).equal(whole)
    if len(shards[0].heads) < num_kv_heads:  # rank 0 alone lacks some heads
        with pytest.raises(ValueError, match="KV head"):
            assemble_blocks(shards[:1], num_kv_heads)


# -- engines ----------------------------------------------------------------
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
def test_tp2_host_tier_serves_saved_and_offloaded_prefixes(request, family):
    """Saved blocks serve a prompt sharing the prefix once the device evicted
    it; those loaded blocks, evicted again, are offloaded byte for byte as
    they were saved (so each rank loaded and read back its own heads: tiny_qwen2's
    greedy tokens barely depend on the context, its bytes do)."""
    with check_host_tier_round_trip(request.getfixturevalue(family), tensor_parallel_size=2) as llm:
        assert llm.stats.external_prefix_hits > 0


@contextlib.contextmanager
def check_host_tier_round_trip(path, **layout):
    """An engine of ``layout`` with a host tier: a prefix saved whole serves
    another prompt once the device evicted it; evicted again, its blocks are
    offloaded byte for byte as saved, and serve the first prompt. Yields the
    engine for the caller's own checks."""
    target = _prompts(1, seed=1, lengths=(200,))[0]
    sharing = target[:160] + _prompts(1, seed=2, lengths=(40,))[0]  # 10 blocks in common
    shared_hashes = hash_request_tokens(target, BLOCK)[:10]
    # Each set needs 50 blocks of the pool's 40: all the target's are evicted.
    others, more_others = _prompts(4, seed=3, lengths=(180, 200)), _prompts(4, seed=10, lengths=(180, 200))
    expected_target, expected_sharing = _hf(path, [target, sharing])
    with LLM(str(path), kv_host_bytes=64 << 20, **layout, **SMALL_POOL_KW) as llm:
        store = llm.engine_core.kv_store
        _check(llm, [target], [expected_target])  # saved to the host tier
        saved = {h: bytes(store.host.get(h)) for h in shared_hashes}
        _generate(llm, others)  # evicts the target's blocks from the device
        hits = store.stats.host_hits
        _check(llm, [sharing], [expected_sharing])
        assert store.stats.host_hits - hits == len(shared_hashes)
        # Offloads: empty the host tier, so what it holds next can only come
        # from blocks the device pool evicts.
        for h in store.host.lru_order():
            store.host.delete(h)
        _generate(llm, more_others)
        offloaded = {h: store.host.get(h) for h in shared_hashes if h in store.host}
        assert offloaded
        assert [h.hex()[:12] for h, value in offloaded.items() if value != saved[h]] == []
        hits = store.stats.host_hits
        _check(llm, [target], [expected_target])
        assert store.stats.host_hits - hits >= 1
        yield llm


def test_redis_blocks_cross_tp_degrees_both_ways(tiny_llama, redis_server):
    """TP=2 writes, TP=1 and a fresh TP=2 read; TP=1 writes, TP=2 reads."""
    reader = check_redis_both_ways(tiny_llama, redis_server, {"tensor_parallel_size": 2},
                                   {"tensor_parallel_size": 2})
    assert reader.stats.external_prefix_hits > 0


def check_redis_both_ways(path, redis_server, writer: dict, reader: dict):
    """An engine of the ``writer`` layout saves two prompts to Redis, which a
    TP=1 engine loads; that one saves two more, and an engine of the ``reader``
    layout loads all four: HF's tokens every time, every full block a Redis hit
    and none refused. Returns the reader (shut down) for more checks."""
    by_writer, by_tp1 = _prompts(2, seed=4), _prompts(2, seed=5)
    expected = _hf(path, by_writer + by_tp1)
    redis = dict(kv_redis_url=redis_server.url)
    with LLM(str(path), **writer, **ENGINE_KW, **redis) as first:
        _check(first, by_writer, expected[:2])
        first.engine_core.kv_store.flush()
    tp1 = LLM(str(path), **ENGINE_KW, **redis)
    _check(tp1, by_writer, expected[:2])  # writer -> TP=1
    assert tp1.engine_core.kv_store.stats.redis_hits == sum(_full_blocks(p) for p in by_writer)
    _check(tp1, by_tp1, expected[2:])
    tp1.engine_core.kv_store.flush()
    with LLM(str(path), **reader, **ENGINE_KW, **redis) as last:
        _check(last, by_writer + by_tp1, expected)  # writer -> reader and TP=1 -> reader
        stats = last.engine_core.kv_store.stats
        assert stats.redis_hits == sum(_full_blocks(p) for p in by_writer + by_tp1)
        assert stats.rejected_values == 0
    return last


def test_tp4_replicated_kv_heads_write_and_read_whole_blocks(tiny_llama, redis_server):
    """4 ranks over 2 KV heads: each head is held by two ranks. The TP=4
    engine loads what TP=1 wrote (each rank slices its replica) and writes
    what TP=1 then reads (each head assembled once)."""
    by_tp1, by_tp4 = _prompts(1, seed=6, lengths=(120,)), _prompts(1, seed=7, lengths=(120,))
    expected = _hf(tiny_llama, by_tp1 + by_tp4)
    redis = dict(kv_redis_url=redis_server.url)
    tp1 = LLM(str(tiny_llama), **ENGINE_KW, **redis)
    _check(tp1, by_tp1, expected[:1])
    tp1.engine_core.kv_store.flush()
    with LLM(str(tiny_llama), tensor_parallel_size=4, **ENGINE_KW, **redis) as tp4:
        _check(tp4, by_tp1, expected[:1])
        assert tp4.engine_core.kv_store.stats.redis_hits == _full_blocks(by_tp1[0])
        _check(tp4, by_tp4, expected[1:])
        tp4.engine_core.kv_store.flush()
    _check(tp1, by_tp4, expected[1:])
    assert tp1.engine_core.kv_store.stats.redis_hits == _full_blocks(by_tp4[0])


def test_tp2_recomputes_corrupted_values_and_survives_redis_down(tiny_llama, redis_server):
    prompts = _prompts(4, seed=8)
    expected = _hf(tiny_llama, prompts)
    redis = dict(kv_redis_url=redis_server.url)
    writer = LLM(str(tiny_llama), **ENGINE_KW, **redis)
    _generate(writer, prompts[:2])
    store = writer.engine_core.kv_store
    store.flush()
    # Overwrite 64 bytes in the middle of prompt 0's third block (huge floats: used, they would show).
    key = store.remote.key(hash_request_tokens(prompts[0], BLOCK)[2])
    value = bytearray(redis_server.client.get(key))
    middle = len(value) // 2
    value[middle: middle + 64] = b"\x7f" * 64
    redis_server.client.set(key, bytes(value))
    with LLM(str(tiny_llama), tensor_parallel_size=2, **ENGINE_KW, **redis) as reader:
        _check(reader, prompts[:2], expected[:2])
        stats = reader.engine_core.kv_store.stats
        assert dict(stats.rejected) == {("redis", "mac"): 1}
        assert stats.redis_hits == 2 + _full_blocks(prompts[1])  # prompt 0's run stops at the bad block
        redis_server.stop()
        start = time.monotonic()
        _check(reader, prompts[2:], expected[2:])
        assert time.monotonic() - start < 60
        assert reader.engine_core.kv_store.remote.errors >= 1


def _produce(llm: LLM, prompt: list[int]) -> list[int]:
    """A prefill pod's request: compute the prompt, put its blocks into
    Redis before the step returns, emit the first token."""
    core = llm.engine_core
    core.add_request(Request(f"produce-{len(prompt)}", prompt, SamplingParams(temperature=0.0, max_tokens=1),
                             kv_transfer_mode="produce"))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
    return tokens


def test_pd_through_redis_between_tp2_and_tp1(tiny_llama, redis_server):
    """Prefill at TP=2, decode at TP=1, and the reverse: the decode side
    loads every full block of the prompt and its tokens equal HF's."""
    check_pd_both_ways(tiny_llama, redis_server, {"tensor_parallel_size": 2})


def check_pd_both_ways(path, redis_server, layout: dict) -> None:
    """P/D through Redis between an engine of ``layout`` and a TP=1 one, each
    way: the prefill side's blocks are in Redis once its first token is out;
    the decode side loads every full block and its tokens equal HF's."""
    prompts = _prompts(2, seed=9, lengths=(150, 90))
    expected = _hf(path, prompts)
    redis = dict(kv_redis_url=redis_server.url)
    tp1 = LLM(str(path), **ENGINE_KW, **redis)
    with LLM(str(path), **layout, **ENGINE_KW, **redis) as other:
        for prefill, decode, prompt, want in [(other, tp1, prompts[0], expected[0]),
                                              (tp1, other, prompts[1], expected[1])]:
            assert _produce(prefill, prompt) == want.token_ids[:1]
            # Synchronous: in Redis once the first token is out, no flush.
            keys = [prefill.engine_core.kv_store.remote.key(h)
                    for h in hash_request_tokens(prompt, BLOCK)[: _full_blocks(prompt)]]
            assert redis_server.client.exists(*keys) == len(keys)
            hits = decode.engine_core.kv_store.stats.redis_hits
            out = _check(decode, [prompt], [want])
            assert out[0].num_cached_tokens == _full_blocks(prompt) * BLOCK
            assert decode.engine_core.kv_store.stats.redis_hits - hits == _full_blocks(prompt)
