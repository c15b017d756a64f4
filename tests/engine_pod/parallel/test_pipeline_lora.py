"""LoRA adapters under pipeline parallelism: each stage holds the slots of
its own decoder layers only and writes an adapter's factors for those layers
(by global layer index); greedy tokens at PP=2 and PP=2 x TP=2, with two
adapters and the base model in one batch, equal Hugging Face + PEFT's.

Float64, as in the other parity tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_pod import LLM, LoRARequest, SamplingParams
from engine_pod.config import create_engine_config
from engine_pod.lora.adapter import inspect_adapter, load_adapter_weights
from engine_pod.lora.config import LoRAConfig
from engine_pod.lora.layers import ModelLoRA, attach_lora
from engine_pod.model.hf_config import load_arch_config
from engine_pod.worker.input_batch import build_batch
from engine_pod.worker.kv_cache import allocate_kv_caches
from tests.engine_pod.lora.test_lora_parity import PROMPTS, hf_peft_greedy
from tests.engine_pod.parallel.test_pipeline_config import CPU, _stage_model

# Which adapter each prompt runs on (None: the base model): both adapters and the base, each twice.
CHOICES = [None, 0, 1, 0, 1, None]
ROWS = [1, 2, 3, 6, 7, 10]  # prompts of 17 to 64 tokens from the LoRA parity tests
MAX_TOKENS = 10  # what hf_peft_greedy generates


def _slot_bytes(lora: ModelLoRA) -> int:
    return sum(layer.a_stacked.nbytes + sum(p.lora_b.nbytes for p in layer.projections) for layer in lora.layers)


def _adapter(base, path, lora_id: int):
    spec = inspect_adapter(LoRARequest(f"adapter-{lora_id}", lora_id, str(path)), load_arch_config(base), 16)
    return load_adapter_weights(spec, torch.float64)


def test_pipeline_parallelism_takes_enable_lora(tiny_llama):
    config = create_engine_config(tiny_llama, device="cpu", pipeline_parallel_size=2, enable_lora=True)
    assert config.lora is not None and config.parallel.pipeline_parallel_size == 2


def test_each_stage_holds_its_layers_factors_and_the_stages_compose_to_the_model(tiny_llama, tiny_llama_loras):
    config = LoRAConfig(max_loras=2, max_lora_rank=16)
    models = [_stage_model(tiny_llama, stage) for stage in (None, 0, 1)]
    whole, first, last = (attach_lora(m, config, torch.float64, CPU) for m in models)
    # Slots on the stage's own layers only, under their global indices; none on the placeholders.
    assert {layer.layer_index for layer in first.layers} == {0, 1}
    assert {layer.layer_index for layer in last.layers} == {2, 3}
    assert not any(hasattr(models[1].model.layers[i], "self_attn") for i in (2, 3))
    assert _slot_bytes(first) == _slot_bytes(last) == _slot_bytes(whole) // 2
    adapters = [_adapter(tiny_llama, tiny_llama_loras[0], 1), _adapter(tiny_llama, tiny_llama_loras[1], 2)]
    for lora in (whole, first, last):
        for slot, weights in enumerate(adapters):
            lora.install(slot, weights)
    # Global layer 2's factors went into the last stage's first layer (not the checkpoint's layer 0).
    a, _ = adapters[0].factors[(2, "q_proj")]
    torch.testing.assert_close(last.layers[0].projections[0].lora_a[0, : a.shape[0]], a, rtol=0, atol=0)

    # Three prompts of 17, 40 and 9 tokens in one step: on adapter 1, adapter 2 and the base model.
    chunks = [list(range(5, 22)), list(range(100, 140)), list(range(300, 309))]
    batch = build_batch(chunks, [0, 0, 0], [[0, 1], [2, 3, 4], [5]], 16, CPU)
    token_slots = np.repeat(np.array([0, 1, -1]), [len(c) for c in chunks])
    whole_model, first_model, last_model = models
    caches = lambda n: list(allocate_kv_caches(whole_model.config, 8, 16, torch.float64, CPU, 1, n))  # noqa: E731
    for lora in (whole, first, last):
        lora.set_mapping(token_slots, None)
    with torch.inference_mode():
        want = whole_model.compute_logits(whole_model(batch.input_ids, batch.positions, caches(4), batch.metadata))
        sent = first_model(batch.input_ids, batch.positions, caches(2), batch.metadata)
        got = last_model.compute_logits(
            last_model(batch.input_ids, batch.positions, caches(2), batch.metadata, None, sent))
        whole.set_mapping(None, None)
        base = whole_model.compute_logits(whole_model(batch.input_ids, batch.positions, caches(4), batch.metadata))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The adapters changed their prompts' rows and left the base model's alone.
    changed = (want - base).abs().amax(dim=1) > 1e-6
    assert changed.tolist() == [c != -1 for c in token_slots.tolist()]


@pytest.fixture(scope="module")
def peft_tokens(tiny_llama, tiny_llama_loras) -> list[list[int]]:
    """The oracle's greedy tokens of each prompt on its adapter."""
    expected: list[list[int]] = [[] for _ in ROWS]
    for choice in (None, 0, 1):
        picked = [i for i, c in enumerate(CHOICES) if c == choice]
        adapter = None if choice is None else tiny_llama_loras[choice]
        for i, tokens in zip(picked, hf_peft_greedy(tiny_llama, adapter, [PROMPTS[ROWS[i]] for i in picked])):
            expected[i] = tokens
    # Else parity would hold for an engine that ignored the adapters.
    assert len({tuple(expected[CHOICES.index(c)]) for c in (None, 0, 1)}) == 3
    return expected


@pytest.mark.slow
@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2)], ids=["pp2", "pp2xtp2"])
def test_two_adapters_and_the_base_in_one_batch_equal_peft(tiny_llama, tiny_llama_loras, peft_tokens, pp, tp):
    loras = [None if c is None else LoRARequest(f"adapter-{c}", c + 1, str(tiny_llama_loras[c])) for c in CHOICES]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # A 32-token budget chunks the prompts, so the last stage samples a subset of the rows.
    with LLM(str(tiny_llama), pipeline_parallel_size=pp, tensor_parallel_size=tp, dtype="float64",
             max_model_len=128, kv_cache_memory_bytes=16 << 20, device="cpu", max_num_batched_tokens=32,
             enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        outputs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in ROWS], params, lora_request=loras)
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, peft_tokens)):
        assert g == e, f"prompt {i} on adapter {CHOICES[i]}: {g} != HF+PEFT {e}"
