"""`tessera bench throughput --step-breakdown`: engine steps grouped by kind
(tessera_tools/bench/step_breakdown.py)."""

from __future__ import annotations

import json

import pytest

from engine_pod.sim.step_profile import StepFeatures
from tessera_tools.bench.step_breakdown import describe, group_of, summarise


def features(prefill: int, decodes: int) -> StepFeatures:
    return StepFeatures(num_prefill_tokens=prefill, num_decode_seqs=decodes, num_context_tokens=0)


@pytest.mark.parametrize("prefill, decodes, kind", [
    (512, 0, "prefill"), (7, 40, "prefill"), (0, 1, "decode 1"), (0, 2, "decode 2"), (0, 3, "decode 3-4"),
    (0, 4, "decode 3-4"), (0, 5, "decode 5-8"), (0, 64, "decode 33-64"), (0, 65, "decode 65-128"),
    (0, 129, "decode 129-256"),
])
def test_a_step_is_grouped_by_what_it_computes(prefill, decodes, kind):
    assert group_of(features(prefill, decodes))[1] == kind


def test_groups_add_up_their_steps_prefill_first_then_by_batch_size():
    samples = [(features(0, 100), 0.2), (features(2000, 30), 2.0), (features(0, 3), 0.05), (features(0, 4), 0.07),
               (features(0, 90), 0.25), (features(100, 0), 0.1)]
    groups = summarise(samples)
    assert [g.kind for g in groups] == ["prefill", "decode 3-4", "decode 65-128"]
    prefill, small, large = groups
    assert (prefill.steps, prefill.prefill_tokens, prefill.decode_seqs) == (2, 2100, 30)
    assert prefill.seconds == pytest.approx(2.1)
    assert (small.steps, small.decode_seqs, small.mean_decodes) == (2, 7, 3.5)
    assert large.ms_per_step == pytest.approx(225.0)
    table = describe(groups)
    assert "decode 65-128" in table and "78.7%" in table  # 2.1 s of 2.67 s


def test_the_command_accounts_for_every_step_and_token(tiny_llama, tmp_path):
    from tessera_tools.cli import main

    out = tmp_path / "steps.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--num-requests", "6", "--max-prompt-len", "48",
                 "--max-output-len", "8", "--max-num-batched-tokens", "64", "--kv-cache-gib", "1",
                 "--step-breakdown", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    steps, engine, workload = report["steps"], report["tessera"], report["workload"]
    assert sum(g["steps"] for g in steps) == engine["steps"]
    # Every prompt token is prefilled once (prefix caching is off); every output token after a
    # request's first (sampled at the end of its prefill) is one decode.
    assert sum(g["prefill_tokens"] for g in steps) == workload["prompt_tokens"]
    assert sum(g["decode_seqs"] for g in steps) == workload["output_tokens"] - workload["num_requests"]
    assert steps[0]["kind"] == "prefill" and steps[0]["steps"] >= workload["prompt_tokens"] // 64
    assert 0 < sum(g["seconds"] for g in steps) <= engine["seconds"]


def test_the_breakdown_is_tesseras_alone(tiny_llama, capsys):
    from tessera_tools.cli import main

    assert main(["bench", "throughput", "--model", str(tiny_llama), "--step-breakdown", "--peer", "vllm"]) == 2
    assert "not with --step-breakdown" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--model", str(tiny_llama), "--step-breakdown", "--profile-ops"])
