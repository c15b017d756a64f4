"""`tessera bench cpu-kernels` on the tiny checkpoint's shapes: both sides of
each comparison agree (the command fails otherwise) and are reported."""

from __future__ import annotations

import json

from tessera_tools.cli import main


def test_cpu_kernels_bench_checks_and_reports_both_sides(tiny_llama, tmp_path):
    out = tmp_path / "cpu.json"
    rc = main(["bench", "cpu-kernels", "--model", str(tiny_llama), "--batches", "1,5", "--context", "40",
               "--tokens", "1,7", "--prefill-tokens", "9,40", "--repeats", "1", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["attention"]] == [1, 5]
    for row in report["attention"]:
        assert row["torch_ms"] > 0 and row["cpu_ms"] > 0 and row["max_abs_diff"] < 1e-3
        assert abs(row["speedup"] - row["torch_ms"] / row["cpu_ms"]) < 1e-9
    assert [r["tokens"] for r in report["linear"]] == [1, 7]
    for row in report["linear"]:
        assert row["dense_ms"] > 0 and row["packed_ms"] > 0 and row["packed_gflops"] > 0
    assert [r["tokens"] for r in report["prefill"]] == [9, 40]
    for row in report["prefill"]:
        assert row["torch_ms"] > 0 and row["cpu_ms"] > 0 and row["max_abs_diff"] < 1e-3
    assert [r["tokens"] for r in report["layers"]] == [1, 7]  # each checked against torch, or rc != 0
    for row in report["layers"]:
        assert row["torch_ms"] > 0 and row["kernels_ms"] > 0
