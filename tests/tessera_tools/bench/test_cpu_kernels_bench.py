"""`tessera bench cpu-kernels` on the tiny checkpoint's shapes: both sides of
each comparison agree (the command fails otherwise) and are reported."""

from __future__ import annotations

import json

import pytest
import torch

from tessera_tools.cli import main


def test_cpu_kernels_bench_checks_and_reports_both_sides(tiny_llama, tmp_path):
    out = tmp_path / "cpu.json"
    rc = main(["bench", "cpu-kernels", "--model", str(tiny_llama), "--batches", "1,5", "--context", "40",
               "--tokens", "1,7", "--prefill-tokens", "9,40", "--shared-requests", "3", "--shared-prefix", "37",
               "--shared-new", "5", "--repeats", "1", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["attention"]] == [1, 5]
    for row in report["attention"]:
        assert row["torch_ms"] > 0 and row["cpu_ms"] > 0 and row["max_abs_diff"] < 1e-3
        assert abs(row["speedup"] - row["torch_ms"] / row["cpu_ms"]) < 1e-9
    assert [r["tokens"] for r in report["linear"]] == [1, 7]
    for row in report["linear"]:
        assert row["dense_ms"] > 0 and row["packed_ms"] > 0 and row["packed_gflops"] > 0
        if torch.ops.tessera_cpu.linear_f32_supported():  # float32 here: the cpu backend's GEMM too
            assert row["own_ms"] > 0 and abs(row["own_vs_packed"] - row["packed_ms"] / row["own_ms"]) < 1e-9
        else:
            assert "own_ms" not in row
    assert [r["tokens"] for r in report["prefill"]] == [9, 40]
    for row in report["prefill"]:
        assert row["torch_ms"] > 0 and row["cpu_ms"] > 0 and row["max_abs_diff"] < 1e-3
    assert [r["tokens"] for r in report["layers"]] == [1, 7]  # each checked against torch, or rc != 0
    for row in report["layers"]:
        assert row["torch_ms"] > 0 and row["kernels_ms"] > 0
    assert [r["step"] for r in report["shared_prefix"]] == ["prefill", "decode"]
    for row in report["shared_prefix"]:
        assert (row["requests"], row["prefix"], row["new"]) == (3, 37, 5)
        assert row["torch_ms"] > 0 and row["cpu_ms"] > 0 and row["max_abs_diff"] < 1e-3


def test_the_shared_prefix_step_shares_its_prefix_blocks():
    import numpy as np
    import torch

    from tessera_tools.bench.cpu_kernels import _shared_prefix_step

    class Arch:
        num_key_value_heads, head_dim = 2, 8

    table, cache = _shared_prefix_step(Arch, requests=3, prefix=37, new=10, block_size=16, dtype=torch.float32,
                                       gen=torch.Generator().manual_seed(0))
    # 37 prefix positions: its two full blocks shared; positions 32-47 (the chunk's 10 and the decoded
    # token's) in one block of each request's own.
    assert table.tolist() == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert cache.shape == (2, 5, 16, 2, 8) and np.unique(table).size == 5
    table, _ = _shared_prefix_step(Arch, requests=2, prefix=37, new=11, block_size=16, dtype=torch.float32,
                                   gen=torch.Generator().manual_seed(0))
    assert table.tolist() == [[0, 1, 2, 3], [0, 1, 4, 5]]  # position 48, the decoded token's, needs a block more


@pytest.mark.parametrize("flag, value", [("--shared-requests", "-1"), ("--shared-prefix", "0"), ("--shared-new", "0")])
def test_bad_shared_prefix_sizes_are_refused_by_name(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "cpu-kernels", "--model", "m", flag, value])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err
