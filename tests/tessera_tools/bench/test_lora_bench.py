"""`tessera bench lora` end to end on the tiny checkpoint: both sides run the
same requests, the adapters change the outputs, and the cold start is timed."""

from __future__ import annotations

import json

from tessera_tools.cli import main


def test_lora_bench_runs_and_reports_both_sides(tiny_llama, tmp_path):
    out = tmp_path / "lora.json"
    rc = main(["bench", "lora", "--model", str(tiny_llama), "--dtype", "float32", "--num-adapters", "2",
               "--lora-rank", "8", "--adapters-dir", str(tmp_path / "adapters"), "--num-requests", "6",
               "--max-prompt-len", "48", "--max-output-len", "8", "--rounds", "2", "--kv-cache-gib", "0.05",
               "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert len(report["tokens_per_second"]["base"]) == len(report["tokens_per_second"]["mixed"]) == 2
    assert report["mixed_over_base"] > 0
    assert report["outputs_changed"] >= 4  # random adapters change nearly every output
    cold = report["cold_start"]
    assert 0 < cold["adapter_read_s"] < cold["cold_request_s"]
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["r8-0", "r8-1", "r8-2"]
