"""EngineCore.step_observer sees every non-empty step's real
SchedulerOutput and the seconds its forward took; unset, nothing changes."""

from __future__ import annotations

from engine_pod import LLM, SamplingParams
from engine_pod.core.scheduler_output import SchedulerOutput
from engine_pod.sim.step_features import step_features


def test_the_observer_is_called_once_per_non_empty_step(tiny_llama):
    seen: list[tuple[SchedulerOutput, float]] = []
    with LLM(str(tiny_llama), dtype="float32", max_model_len=128, max_num_batched_tokens=16,
             kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False) as llm:
        assert llm.engine_core.step_observer is None
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        prompts = [{"prompt_token_ids": list(range(20, 40))}, {"prompt_token_ids": list(range(50, 55))}]
        unobserved = llm.generate(prompts, params)
        steps_before = llm.stats.steps
        llm.engine_core.step_observer = lambda output, seconds: seen.append((output, seconds))
        observed = llm.generate(prompts, params)
        steps = llm.stats.steps - steps_before
    assert [o.outputs[0].token_ids for o in observed] == [o.outputs[0].token_ids for o in unobserved]
    assert len(seen) == steps and all(not out.is_empty and seconds > 0 for out, seconds in seen)
    features = [step_features(out) for out, _ in seen]
    # 25 prompt tokens through a 16-token budget, then every output token but the last decoded.
    assert sum(f.num_prefill_tokens for f in features) == 25
    assert sum(f.num_decode_seqs for f in features) == 2 * 2
    assert features[0].num_prefill_tokens == 16 and features[0].num_context_tokens == 0
