"""The KV store under pipeline parallelism: each stage holds only its own
layers' KV, the store whole blocks (every layer, every head). A rank loads its
stage's layers of its heads out of a whole block; on save or offload the
executor assembles the whole block from every stage's and every TP rank's
share (engine_pod/worker/kv_shards.py). So engines of any PP x TP layout
share the host tier's and Redis's values, and a prefill pod at PP=2 hands KV
to a decode pod at TP=1.

Hugging Face Transformers is the oracle (float64, token for token with
logprobs), as in test_kv_store_tensor_parallel.py, whose helpers this uses.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from engine_pod.distributed.parallel_state import stage_layers
from engine_pod.model.parallel_layers import kv_head_range
from engine_pod.worker.kv_shards import RankBlocks, assemble_blocks, rank_share
from tests.kv_store.test_kv_store_tensor_parallel import (
    BLOCK,
    check_host_tier_round_trip,
    check_pd_both_ways,
    check_redis_both_ways,
)


@pytest.mark.parametrize("num_layers, pp, num_kv_heads, tp", [(4, 2, 2, 1), (4, 2, 2, 2), (5, 3, 1, 2), (4, 4, 2, 4)])
def test_every_stages_and_ranks_share_assembles_the_whole_block(num_layers, pp, num_kv_heads, tp):
    whole = torch.randn(3, num_layers, 2, BLOCK, num_kv_heads, 4, dtype=torch.float64)
    shards = []
    for stage in range(pp):
        layers = stage_layers(num_layers, stage, pp)
        for rank in range(tp):
            heads = kv_head_range(num_kv_heads, tp, rank)
            shards.append(RankBlocks(heads, rank_share(whole, heads, layers).contiguous(), layers))
    assert assemble_blocks(shards, num_kv_heads, num_layers).equal(whole)
    assert assemble_blocks(pickle.loads(pickle.dumps(shards)), num_kv_heads, num_layers).equal(whole)
    with pytest.raises(ValueError, match="layer"):
        assemble_blocks(shards[tp:], num_kv_heads, num_layers)  # stage 0 missing
    with pytest.raises(ValueError, match="layers"):
        assemble_blocks(shards[:-tp], num_kv_heads, num_layers)  # the last stage missing


pytestmark_engines = pytest.mark.slow  # worker processes


@pytestmark_engines
def test_host_tier_serves_saved_and_offloaded_prefixes_under_pp2xtp2(tiny_llama):
    """Each rank loads and reads back its stage's layers of its heads (PP=2 alone
    is the Redis test's writer)."""
    with check_host_tier_round_trip(tiny_llama, pipeline_parallel_size=2, tensor_parallel_size=2) as llm:
        assert llm.stats.max_steps_in_flight == 2  # the stages worked on different steps at once


@pytestmark_engines
def test_redis_blocks_cross_pp_and_tp_layouts_both_ways(tiny_llama, redis_server):
    """PP=2 writes, TP=1 reads; TP=1 writes, PP=2 x TP=2 reads."""
    check_redis_both_ways(tiny_llama, redis_server, {"pipeline_parallel_size": 2},
                          {"pipeline_parallel_size": 2, "tensor_parallel_size": 2})


@pytestmark_engines
def test_pd_through_redis_from_a_pp2_prefill_to_a_tp1_decode_and_back(tiny_llama, redis_server):
    check_pd_both_ways(tiny_llama, redis_server, {"pipeline_parallel_size": 2})
