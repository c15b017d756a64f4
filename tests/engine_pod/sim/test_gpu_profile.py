"""The shipped GPU-class step-time profile (Llama-3.1-8B, bf16, one H100 SXM),
derived from published figures: it loads, its predictions for a few steps lie
inside the ranges those figures allow, and it is far faster than the CPU
profile for the same step. Derivation and sources: docs/simulation-profiles.md."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine_pod.sim
from engine_pod.sim.step_profile import StepFeatures, StepTimeProfile

PROFILES = Path(engine_pod.sim.__file__).parent / "profiles"
GPU_PROFILE = PROFILES / "h100-llama3.1-8b-bf16.json"
CPU_PROFILE = PROFILES / "bench-cpu.json"

# Llama-3.1-8B's shape (its Hugging Face config): 32 layers, hidden 4096, MLP 14336, 8 KV heads of 128, vocab 128256.
LINEAR_PARAMS = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # q, o, k, v, gate/up/down
LM_HEAD_PARAMS = 128256 * 4096
WEIGHT_BYTES_PER_STEP = 2 * (LINEAR_PARAMS + LM_HEAD_PARAMS)  # bf16, read once per step (the embedding is gathered)
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, head dim 128, bf16: 128 KiB

# NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3. No step can read its bytes faster.
H100_HBM_BYTES_PER_S = 3.35e12

# lmdeploy issue #1608 ("Long context: Decoding performance degradation"): vLLM 0.4.2, Meta-Llama-3-8B-Instruct,
# TP1 on an H800 (same HBM3 and tensor cores as an H100 SXM): TPOT 8.66 ms at a 1k prompt, 30 ms at a 200k prompt.
# TPOT also counts the scheduler's CPU time, which a step does not, so both are ceilings for the step.
VLLM_042_TPOT_1K_S = 8.66e-3
VLLM_042_TPOT_200K_S = 30e-3
PROMPT_200K = 200 * 1024

# "vLLM throughput-latency sweep on NVIDIA A100" (johnmusgrave.com): Llama-3.1-8B-Instruct bf16, vLLM 0.23.0,
# A100 40GB (1.555 TB/s), one request at a time: about 75 tokens/s. Decode is bandwidth-bound, so scaled to an H100.
A100_SWEEP_ITL_S = 1 / 75
A100_40GB_HBM_BYTES_PER_S = 1.555e12

# Lambda "LLMs inference benchmarks, using vLLM, on Lambda Cloud": Llama 3.1 8B, 1x H100 SXM, vLLM 0.6.0 with
# 10 scheduler steps, max-num-seqs 256, requests at rate inf: median TPOT 25.57 ms (prefills interleaved). A step of
# 128 sequences decoding, half that batch and no prefill, is cheaper.
LAMBDA_TPOT_256_SEQS_S = 25.57e-3

# Vidur's H100 profiling data (microsoft/vidur, .../h100/meta-llama/Llama-2-7b-hf/mlp.csv): the 32 decoder layers of
# Llama-2-7B take 40.4 ms for 2048 tokens (median per op, TP1). Llama-3-8B does 7.7% more linear FLOPs per token
# and adds attention and lm_head, so this is a floor for its 2048-token prefill step.
VIDUR_H100_LLAMA2_7B_2048_LAYERS_S = 40.42e-3
# TensorRT-LLM "Performance Overview": Llama 3.1 8B FP8, 1x H100 SXM, ISL/OSL 2048/128: 3,450 output tokens/s,
# i.e. 3450 / 128 * 2048 = 55,200 prompt tokens/s. bf16's tensor peak is half FP8's (989 vs 1979 TFLOP/s), so at no
# worse efficiency a bf16 2048-token prefill takes at most twice the FP8 time.
TRTLLM_FP8_PREFILL_TOKENS_PER_S = 3450 / 128 * 2048
BF16_OVER_FP8_PEAK = 2.0


@pytest.fixture(scope="module")
def gpu() -> StepTimeProfile:
    return StepTimeProfile.load(GPU_PROFILE)


@pytest.fixture(scope="module")
def cpu() -> StepTimeProfile:
    return StepTimeProfile.load(CPU_PROFILE)


def _floor(context_tokens: int) -> float:
    """The HBM-bound floor of a decode step: weights and the cached KV read once at peak bandwidth."""
    return (WEIGHT_BYTES_PER_STEP + context_tokens * KV_BYTES_PER_TOKEN) / H100_HBM_BYTES_PER_S


DECODE_1_SHORT = StepFeatures(num_prefill_tokens=0, num_decode_seqs=1, num_context_tokens=1024)
DECODE_1_LONG = StepFeatures(num_prefill_tokens=0, num_decode_seqs=1, num_context_tokens=PROMPT_200K)
DECODE_128 = StepFeatures(num_prefill_tokens=0, num_decode_seqs=128, num_context_tokens=128 * 512)
PREFILL_2048 = StepFeatures(num_prefill_tokens=2048, num_decode_seqs=0, num_context_tokens=0)


def test_the_shipped_profile_loads_and_says_it_is_derived(gpu):
    assert gpu.fitted_steps == 0
    assert "DERIVED from published figures, NOT measured" in gpu.source
    assert "H100" in gpu.source and "Llama-3.1-8B" in gpu.source
    assert all(c > 0 for c in gpu.coefficients())


def test_a_one_sequence_decode_at_short_context(gpu):
    seconds = gpu.predict(DECODE_1_SHORT)
    assert _floor(1024) < seconds < VLLM_042_TPOT_1K_S, seconds
    # The A100 sweep's figure scaled by bandwidth (6.2 ms); the fixed overhead does not scale, hence the margin.
    scaled = A100_SWEEP_ITL_S * A100_40GB_HBM_BYTES_PER_S / H100_HBM_BYTES_PER_S
    assert seconds == pytest.approx(scaled, rel=0.2)


def test_a_one_sequence_decode_at_long_context(gpu):
    seconds = gpu.predict(DECODE_1_LONG)
    assert _floor(PROMPT_200K) < seconds < VLLM_042_TPOT_200K_S, seconds


def test_a_128_sequence_decode(gpu):
    seconds = gpu.predict(DECODE_128)
    assert _floor(128 * 512) < seconds < LAMBDA_TPOT_256_SEQS_S, seconds


def test_a_2048_token_prefill(gpu):
    seconds = gpu.predict(PREFILL_2048)
    fp8_seconds = 2048 / TRTLLM_FP8_PREFILL_TOKENS_PER_S
    assert VIDUR_H100_LLAMA2_7B_2048_LAYERS_S < seconds < BF16_OVER_FP8_PEAK * fp8_seconds, seconds


def test_attending_a_cached_token_costs_its_kv_read_at_no_more_than_peak_bandwidth(gpu):
    floor = KV_BYTES_PER_TOKEN / H100_HBM_BYTES_PER_S
    assert floor < gpu.per_context_token_s < 2 * floor


@pytest.mark.parametrize("step", [DECODE_1_SHORT, DECODE_1_LONG, DECODE_128, PREFILL_2048],
                         ids=["decode-1-short", "decode-1-long", "decode-128", "prefill-2048"])
def test_much_faster_than_the_cpu_profile(gpu, cpu, step):
    # An 8B model on an H100 against the bench checkpoint on one CPU thread: the
    # closest pair (a one-sequence decode at 1k context) is 5.6x apart.
    assert gpu.predict(step) * 4 < cpu.predict(step)
