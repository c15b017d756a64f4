"""An engine pod with --speculative-config: streams the same greedy tokens as
the offline engine without speculation, and exposes the drafting counters."""

from __future__ import annotations

import asyncio
import json

from engine_pod import LLM, SamplingParams
from engine_pod.server.process import EnginePodProcess
from tests.engine_pod.test_spec_decode import SPEC, copy_prompts
from tests.engine_pod.server.client import generate_all, greedy, scrape_metrics
from tests.engine_pod.server.conftest import POD_ARGS


def test_pod_speculates_and_counts_drafts(tiny_llama, tmp_path):
    prompts, max_tokens = copy_prompts(4, seed=1), [30, 12, 30, 25]
    with LLM(str(tiny_llama), dtype="float64", max_model_len=256, kv_cache_memory_bytes=32 << 20) as llm:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    args = [*POD_ARGS, "--cpu-threads", "1", "--speculative-config", json.dumps(SPEC)]
    with EnginePodProcess(tiny_llama, args, log_path=tmp_path / "pod.log") as pod:
        pod.wait_serving()
        before = scrape_metrics(pod)
        requests = [greedy(p, n, ignore_eos=True) for p, n in zip(prompts, max_tokens)]
        results = asyncio.run(generate_all(pod.address, requests))
        after = scrape_metrics(pod)
    assert [tokens for tokens, _ in results] == want

    def delta(name):
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    drafts = delta("tessera_spec_decode_num_drafts_total")
    draft_tokens = delta("tessera_spec_decode_num_draft_tokens_total")
    accepted = delta("tessera_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= draft_tokens <= drafts * SPEC["num_speculative_tokens"]
    # Steps that emit several tokens count each of them.
    assert delta("tessera_generation_tokens_total") == sum(max_tokens)
