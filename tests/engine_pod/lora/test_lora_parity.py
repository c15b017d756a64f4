"""Requests on LoRA adapters give Hugging Face + PEFT's greedy tokens, token for
token, batched with requests of other adapters and of the base model, under
every engine feature (docs/architecture.md, invariant 2). Float64, like the
base model's parity tests, so the comparison is well-posed."""

from __future__ import annotations

import random

import pytest
import torch

from engine_pod import LLM, LoRARequest, SamplingParams

FAMILIES = ["llama", "qwen2"]
MAX_TOKENS = 10
# Which adapter each prompt runs on (None: the base model): all three adapters and the
# base in one batch, each more than once.
CHOICES = [None, 0, 1, 2, 0, 2, None, 1, 2, 0, 1, None]


def _prompts() -> list[list[int]]:
    """12 prompts; prompts i and i + 6 share a 40-token prefix but run on other
    adapters, so a cache shared across adapters would serve the wrong KV."""
    rng = random.Random(7)
    lengths = [5, 17, 33, 64, 90, 121, 45, 52, 70, 100, 41, 80]
    prefixes = [[rng.randrange(5, 6000) for _ in range(40)] for _ in range(6)]
    prompts = []
    for i, length in enumerate(lengths):
        head = prefixes[i % 6][: min(40, length - 1)] if length > 40 else []
        prompts.append(head + [rng.randrange(5, 6000) for _ in range(length - len(head))])
    return prompts


PROMPTS = _prompts()


def hf_peft_greedy(base, adapter, prompts: list[list[int]]) -> list[list[int]]:
    """The oracle: transformers' model with PEFT applying the adapter, one prompt at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float64)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(base checkpoint, its three adapters, the oracle's tokens per prompt)."""
    name = request.param
    base = request.getfixturevalue(f"tiny_{name}")
    adapters = request.getfixturevalue(f"tiny_{name}_loras")
    expected: list[list[int] | None] = [None] * len(PROMPTS)
    for choice in (None, 0, 1, 2):
        rows = [i for i, c in enumerate(CHOICES) if c == choice]
        tokens = hf_peft_greedy(base, None if choice is None else adapters[choice], [PROMPTS[i] for i in rows])
        for i, t in zip(rows, tokens):
            expected[i] = t
    return base, adapters, expected


def lora_requests(adapters) -> list[LoRARequest | None]:
    return [None if c is None else LoRARequest(f"adapter-{c}", c + 1, str(adapters[c])) for c in CHOICES]


def run(base, adapters, **engine_kwargs):
    kwargs = dict(dtype="float64", max_model_len=512, kv_cache_memory_bytes=64 << 20, enable_lora=True,
                  max_loras=3, max_lora_rank=16)
    kwargs.update(engine_kwargs)
    llm = LLM(str(base), **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=lora_requests(adapters))
    return llm, [o.outputs[0].token_ids for o in outputs]


def assert_parity(got, expected) -> None:
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} on adapter {CHOICES[i]}: {g} != HF+PEFT {e}"


def test_the_adapters_change_the_outputs(family):
    """Else parity would hold for an engine that ignored the adapters."""
    _, _, expected = family
    by_prompt_prefix = {}
    for i, c in enumerate(CHOICES):
        by_prompt_prefix.setdefault(c, []).append(expected[i][:3])
    assert len({tuple(map(tuple, v)) for v in by_prompt_prefix.values()}) == 4


def test_three_adapters_and_the_base_in_one_batch(family):
    base, adapters, expected = family
    llm, got = run(base, adapters, enable_prefix_caching=False)
    assert_parity(got, expected)


def test_prefix_caching_on(family):
    base, adapters, expected = family
    llm, got = run(base, adapters, enable_prefix_caching=True)
    assert_parity(got, expected)


@pytest.mark.parametrize("budget", [16, 64])
def test_chunked_prefill(family, budget):
    base, adapters, expected = family
    llm, got = run(base, adapters, max_num_batched_tokens=budget)
    assert_parity(got, expected)
    assert llm.stats.steps > sum(len(p) for p in PROMPTS) // budget  # prompts were chunked


def test_preemption(family):
    base, adapters, expected = family
    # 20 blocks of 16 tokens for 12 prompts of 5 to 121 (+ 10) tokens, 768 in all.
    llm, got = run(base, adapters, num_gpu_blocks=20, max_model_len=256, max_num_batched_tokens=128)
    assert_parity(got, expected)
    assert llm.stats.num_preemptions > 0


def test_one_slot_for_three_adapters(family):
    """max_loras=1: requests of other adapters wait for the slot, and each
    adapter is written into it again when its turn comes."""
    base, adapters, expected = family
    llm, got = run(base, adapters, max_loras=1, max_cpu_loras=1)
    assert_parity(got, expected)


@pytest.mark.slow
def test_tensor_parallel(family):
    """TP=2 in worker processes: each rank holds its share of every adapter."""
    base, adapters, expected = family
    llm, got = run(base, adapters, tensor_parallel_size=2)
    try:
        assert_parity(got, expected)
    finally:
        llm.shutdown()


def test_triton_kernels_in_the_engine(tiny_qwen2, tiny_qwen2_loras):
    """The Triton path (the GPU's; here under the interpreter, with the triton
    attention backend, which runs float32 at most) gives the torch path's
    tokens, on a few short prompts of the base model and all three adapters.
    One family: the kernels see only projections' inputs and outputs, and
    the interpreter makes each run slow; Qwen2's biased projections are the
    superset."""
    base, adapters = tiny_qwen2, tiny_qwen2_loras
    rows = [0, 1, 2, 3, 5]
    prompts = [{"prompt_token_ids": PROMPTS[i][:24]} for i in rows]
    loras = [lora_requests(adapters)[i] for i in rows]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("triton", "torch"):
        with LLM(str(base), dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20, enable_lora=True,
                 max_loras=3, attention_backend=backend, max_num_batched_tokens=32) as llm:
            tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
            if backend == "torch":
                base_only = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
    assert tokens["torch"][0] == base_only[0]
    # The adapters made a difference (tiny-qwen2's rank-4 q/v/down adapter may leave the
    # 4 tokens of one prompt as they were).
    assert sum(t != b for t, b in zip(tokens["torch"][1:], base_only[1:])) >= 3
