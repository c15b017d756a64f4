"""`tessera bench pp`: both sides on the same requests, each stage's busy and
waiting time, and the bubble; the figures' arithmetic on its own."""

from __future__ import annotations

import json

import pytest

from engine_pod.worker.stage_timing import StageTiming, bubble_fraction, stage_leaders
from tessera_tools.cli import main


def test_bubble_is_the_stages_share_of_time_not_computing():
    # Two stages over a 10 s run: one computed 6 s, the other 4 s, so 10 of 20 stage-seconds idled.
    first = StageTiming(stage=0, tp_rank=0, steps=100, step_seconds=9.0, wait_seconds=3.0)
    last = StageTiming(stage=1, tp_rank=0, steps=100, step_seconds=9.5, wait_seconds=5.5)
    follower = StageTiming(stage=1, tp_rank=1, steps=100, step_seconds=9.5, wait_seconds=9.0)
    assert stage_leaders([follower, last, first]) == [first, last]  # a stage counts once, by its TP rank 0
    assert bubble_fraction([last, follower, first], 10.0) == pytest.approx(0.5)
    assert bubble_fraction([StageTiming(0, 0, 10, 2.0, 0.0)], 2.0) == pytest.approx(0.0)
    earlier = StageTiming(stage=0, tp_rank=0, steps=40, step_seconds=4.0, wait_seconds=1.0)
    assert first.since(earlier) == StageTiming(0, 0, 60, 5.0, 2.0)
    with pytest.raises(ValueError):
        bubble_fraction([], 1.0)


def test_the_command_reports_both_sides_with_each_stages_time(tiny_llama, tmp_path):
    out = tmp_path / "pp.json"
    rc = main(["bench", "pp", "--model", str(tiny_llama), "--dtype", "float32", "--num-requests", "4",
               "--max-prompt-len", "32", "--max-output-len", "8", "--rounds", "1", "--kv-cache-gib", "0.05",
               "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    (one,), (two,) = report["runs"]["pp1"], report["runs"]["pp2"]
    assert [s["stage"] for s in one["stages"]] == [0] and [s["stage"] for s in two["stages"]] == [0, 1]
    assert one["output_tokens"] == two["output_tokens"] > 0
    # Two stages taking turns on one batch: each waits for the other, so at least a third of their time idles.
    assert 1 / 3 < two["bubble_fraction"] < 1 and one["bubble_fraction"] < two["bubble_fraction"]
    assert all(s["wait_ms_per_step"] > 0 for s in two["stages"])
    assert report["throughput_ratio"] > 0 and report["greedy_outputs_equal"].endswith("/4")


def test_more_stages_than_layers_exits_2(tiny_llama, capsys):
    assert main(["bench", "pp", "--model", str(tiny_llama), "--pipeline-parallel-size", "64"]) == 2
    assert "exceeds the model's" in capsys.readouterr().out
