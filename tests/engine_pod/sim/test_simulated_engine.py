"""A simulated engine: the real EngineCore (scheduler, KV cache manager,
prefix caching, chunked prefill, preemption) over the SimulatedExecutor,
whose steps last what the profile predicts and whose tokens are those of
engine_pod/sim/tokens.py. The sleep is recorded instead of slept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_pod.config import create_engine_config
from engine_pod.engine.engine_core import EngineCore
from engine_pod.executor.simulated import SimulatedExecutor
from engine_pod.processor import Processor
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams
from engine_pod.sim.step_features import step_features
from engine_pod.sim.step_profile import StepTimeProfile
from engine_pod.sim.tokens import simulated_output
from engine_pod.structured_output import StructuredOutputsParams
from tessera.text import load_eos_token_ids

PROFILE = StepTimeProfile(base_s=0.01, per_prefill_token_s=1e-4, per_decode_seq_s=1e-3, per_context_token_s=1e-6)


def _engine(model, **kwargs) -> tuple[EngineCore, list[float]]:
    config = create_engine_config(model, simulate=True, max_model_len=128, **kwargs)
    slept: list[float] = []
    return EngineCore(config, executor=SimulatedExecutor(config, PROFILE, sleep=slept.append)), slept


def _run(core: EngineCore, prompts: list[list[int]], max_tokens: int, **params) -> dict[str, list[int]]:
    processor = Processor(core.config, tokenizer=None, eos_token_ids=load_eos_token_ids(core.config.model.path))
    for i, prompt in enumerate(prompts):
        sampling = processor.process_params(SamplingParams(temperature=0.0, max_tokens=max_tokens, **params))
        core.add_request(Request(f"r{i}", prompt, sampling))
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs


def _expected(model, prompts, max_tokens) -> dict[str, list[int]]:
    eos = load_eos_token_ids(model)
    return {f"r{i}": simulated_output(p, max_tokens, 8192, eos) for i, p in enumerate(prompts)}


PROMPTS = [list(range(20, 60)), list(range(5, 12)), list(range(300, 333))]


def test_tokens_are_the_prompts_own_under_chunked_prefill(tiny_llama):
    core, _ = _engine(tiny_llama, num_gpu_blocks=64, max_num_batched_tokens=16)
    assert _run(core, PROMPTS, 6) == _expected(tiny_llama, PROMPTS, 6)


def test_tokens_survive_preemption(tiny_llama):
    # 8 blocks of 16 tokens for three requests growing to 70+ tokens: some are preempted and recomputed.
    core, _ = _engine(tiny_llama, num_gpu_blocks=8, max_num_batched_tokens=64)
    outputs = _run(core, PROMPTS, 40)
    assert core.totals.num_preemptions > 0
    assert outputs == _expected(tiny_llama, PROMPTS, 40)


def test_a_repeated_prompt_hits_the_prefix_cache_and_gets_the_same_tokens(tiny_llama):
    core, _ = _engine(tiny_llama, num_gpu_blocks=64)
    first = _run(core, [PROMPTS[0]], 4)
    hits_before = core.totals.prefix_cache_hits
    again = _run(core, [PROMPTS[0]], 4)
    assert core.totals.prefix_cache_hits - hits_before >= 32  # two full 16-token blocks of the 40-token prompt
    assert again == first


def test_each_step_sleeps_what_the_profile_predicts(tiny_llama):
    core, slept = _engine(tiny_llama, num_gpu_blocks=64, max_num_batched_tokens=16)
    predicted: list[float] = []
    core.step_observer = lambda output, seconds: predicted.append(PROFILE.predict(step_features(output)))
    _run(core, PROMPTS[:2], 3)
    assert len(slept) == core.totals.steps and slept == pytest.approx(predicted)
    assert slept[0] == pytest.approx(0.01 + 16 * 1e-4)  # the first step: a 16-token prefill chunk alone


def test_the_kv_pool_is_sized_from_the_checkpoints_block_bytes(tiny_llama):
    # tiny: 4 layers, 2 KV heads of 64, float32; 16-token blocks: 2*4*2*64*16*4 = 65536 bytes.
    core, _ = _engine(tiny_llama, kv_cache_memory_bytes=10 * 65536 + 100)
    assert core.num_blocks == 10


@pytest.mark.parametrize("kwargs, field", [
    ({"dtype": "bfloat16"}, "dtype"),
    ({"device": "cpu"}, "device"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
])
def test_what_a_simulation_does_not_model_is_refused(tiny_llama, kwargs, field):
    with pytest.raises(ValueError, match=field):
        create_engine_config(tiny_llama, simulate=True, **kwargs)


@pytest.mark.parametrize("params, field", [
    ({"structured_outputs": StructuredOutputsParams(choice=["a", "b"])}, "structured_outputs"),
    ({"logprobs": 0}, "logprobs"),
])
def test_a_simulated_engine_refuses_what_it_cannot_honour(tiny_llama, params, field):
    config = create_engine_config(tiny_llama, simulate=True, max_model_len=128)
    processor = Processor(config, tokenizer=None, eos_token_ids=set())
    with pytest.raises(ValueError, match=field):
        processor.process_params(SamplingParams(max_tokens=4, **params))


def test_a_simulated_engine_imports_no_torch(tiny_llama):
    script = (
        "import sys; sys.modules['torch'] = None; sys.modules['xgrammar'] = None\n"
        "from engine_pod.config import create_engine_config\n"
        "from engine_pod.engine.engine_core import EngineCore\n"
        "from engine_pod.executor.simulated import SimulatedExecutor\n"
        "import engine_pod.server.main\n"
        "from engine_pod.sim.step_profile import StepTimeProfile\n"
        f"config = create_engine_config({str(tiny_llama)!r}, simulate=True, num_gpu_blocks=16, max_model_len=64)\n"
        "core = EngineCore(config, SimulatedExecutor(config, StepTimeProfile(0.0, 0.0, 0.0, 0.0)))\n"
        "print(core.num_blocks)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "16"
