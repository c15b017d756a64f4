"""Pipeline parallelism without processes: the layer split, the config's
checks and refusals, and each stage's model (its layers' weights only; two
stages run one after the other in this process equal the whole model)."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine_pod.attention.selector import get_attention_backend
from engine_pod.config import ParallelConfig, create_engine_config
from engine_pod.distributed.parallel_state import PipelineGroup, single_rank_group, stage_layers
from engine_pod.entrypoints.cli_args import add_engine_args, engine_kwargs
from engine_pod.model.hf_config import load_arch_config
from engine_pod.model.loader import build_model
from engine_pod.worker.input_batch import build_batch
from engine_pod.worker.kv_cache import allocate_kv_caches, bytes_per_block

CPU = torch.device("cpu")


@pytest.mark.parametrize("layers, stages, sizes", [
    (4, 2, [2, 2]), (5, 2, [3, 2]), (10, 4, [2, 3, 3, 2]), (7, 3, [2, 3, 2]), (4, 4, [1, 1, 1, 1]), (3, 1, [3]),
])
def test_layers_split_like_vllm_remainder_before_the_last_stage(layers, stages, sizes):
    ranges = [stage_layers(layers, s, stages) for s in range(stages)]
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(layers))  # contiguous, in order, all of them


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "2"])
def test_pipeline_parallel_size_must_be_a_positive_integer(size):
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        ParallelConfig(pipeline_parallel_size=size)


def test_world_size_is_pp_times_tp():
    assert ParallelConfig().world_size == 1
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6


def test_more_stages_than_layers_names_both_numbers(tiny_llama):
    arch = load_arch_config(tiny_llama)
    ParallelConfig(pipeline_parallel_size=4).validate_for(arch)
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 exceeds the model's num_hidden_layers=4"):
        ParallelConfig(pipeline_parallel_size=5).validate_for(arch)
    with pytest.raises(ValueError, match="pipeline_parallel_size=5"):
        create_engine_config(tiny_llama, device="cpu", pipeline_parallel_size=5)


def test_what_pipeline_parallelism_cannot_do_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="pipeline_parallel_size") as info:
        create_engine_config(tiny_llama, pipeline_parallel_size=2, simulate=True)
    assert "simulated" in str(info.value)
    create_engine_config(tiny_llama, pipeline_parallel_size=1, simulate=True)  # fine without PP


def test_the_kv_store_is_taken_under_pipeline_parallelism(tiny_llama):
    config = create_engine_config(tiny_llama, pipeline_parallel_size=2, kv_host_bytes=1 << 20)
    assert config.kv_store.enabled and config.parallel.pipeline_parallel_size == 2


def test_the_flag_reaches_the_config(tiny_llama):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(tiny_llama), "--pipeline-parallel-size", "2",
                              "--tensor-parallel-size", "2", "--device", "cpu"])
    config = create_engine_config(tiny_llama, **engine_kwargs(args))
    assert config.parallel == ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)


def _stage_model(path, stage: int | None, num_stages: int = 2):
    arch = load_arch_config(path)
    backend = get_attention_backend("torch", CPU, arch.head_dim, torch.float64)
    pp = None if stage is None else PipelineGroup(stage, num_stages, 1, stage, CPU)
    return build_model(arch, path, 256, torch.float64, CPU, backend, single_rank_group(CPU), pp)


def _names(model) -> set[str]:
    return {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
def test_each_stage_holds_its_layers_and_the_stages_compose_to_the_model(request, family):
    path = request.getfixturevalue(family)
    arch = load_arch_config(path)
    whole, first, last = _stage_model(path, None), _stage_model(path, 0), _stage_model(path, 1)
    layers = lambda m: {int(n.split(".")[2]) for n in _names(m) if n.startswith("model.layers.")}  # noqa: E731
    assert (layers(first), layers(last)) == ({0, 1}, {2, 3})
    assert "model.embed_tokens" in _names(first) and "model.norm" not in _names(first)
    assert "model.norm" in _names(last)
    # The last stage's LM head: its own (Llama) or the tied embedding (Qwen2).
    assert ("model.embed_tokens" in _names(last)) == arch.tie_word_embeddings
    assert ("lm_head" in _names(last)) == (not arch.tie_word_embeddings)
    assert not {"lm_head"} & _names(first)
    # Each stage's KV blocks hold its layers only: half the bytes of the whole model's.
    assert bytes_per_block(arch, 16, torch.float64, 1, 2) * 2 == bytes_per_block(arch, 16, torch.float64)

    # Two prompts of 17 and 40 tokens in one flattened step.
    chunks = [list(range(5, 22)), list(range(100, 140))]
    batch = build_batch(chunks, [0, 0], [[0, 1], [2, 3, 4]], 16, CPU)
    caches = lambda n: list(allocate_kv_caches(arch, 8, 16, torch.float64, CPU, 1, n))  # noqa: E731
    with torch.inference_mode():
        want = whole.compute_logits(whole(batch.input_ids, batch.positions, caches(4), batch.metadata))
        sent = first(batch.input_ids, batch.positions, caches(2), batch.metadata)
        assert isinstance(sent, tuple) and [t.shape for t in sent] == [(57, arch.hidden_size)] * 2
        got = last.compute_logits(last(batch.input_ids, batch.positions, caches(2), batch.metadata, None, sent))
    torch.testing.assert_close(got, want, rtol=0, atol=0)



def test_a_pod_of_a_multi_node_group_needs_only_its_own_ranks_gpus(monkeypatch):
    """PP=2 x TP=2 over two nodes: each pod holds 2 of the 4 ranks, so 2 visible GPUs suffice there;
    on one node all 4 are needed."""
    import torch

    from engine_pod.config import NodeLayout, ParallelConfig, _check_device_count

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cuda = torch.device("cuda")
    two_nodes = NodeLayout(nnodes=2, node_rank=1, master_addr="10.0.0.1")
    _check_device_count(cuda, ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nodes=two_nodes))
    with pytest.raises(ValueError, match="needs 4 CUDA devices; 2 visible"):
        _check_device_count(cuda, ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="needs 2 CUDA devices on each of its 2 nodes; 1 visible"):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        _check_device_count(cuda, ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nodes=two_nodes))


def test_the_node_layout_reaches_the_engine_config(tiny_llama):
    from engine_pod.config import NodeLayout, create_engine_config

    layout = NodeLayout(nnodes=2, node_rank=1, master_addr="127.0.0.1")
    config = create_engine_config(tiny_llama, pipeline_parallel_size=2, device="cpu", nodes=layout)
    assert config.parallel.nodes == layout and config.parallel.local_world_size == 1
