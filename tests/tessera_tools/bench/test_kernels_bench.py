"""`tessera bench kernels`: its refusal without CUDA and the pure helpers
behind its figures (the GPU parts run on a CUDA machine only)."""

from __future__ import annotations

import argparse

import pytest
import torch

from tessera_tools.bench.kernels import (
    DecodeShape, Heads, add_parser, decode_shapes, kv_bytes_read, markdown_decode_table, peak_bandwidth_tbps,
    target_verdict,
)

LLAMA_8B = Heads(num_heads=32, num_kv_heads=8, head_dim=128)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["kernels", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal is for machines without CUDA")
def test_refuses_without_cuda(capsys, tmp_path):
    args = _parse(["--output", str(tmp_path / "k.json")])
    assert args.bench_func(args) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "k.json").exists()


def test_kv_bytes_of_a_batch_64_4k_decode_step():
    # 64 sequences x 4096 tokens x 8 KV heads x 128 dims x (K and V) x 2 bytes.
    assert kv_bytes_read([4096] * 64, LLAMA_8B, element_size=2) == 2**30
    assert kv_bytes_read([1, 3], Heads(4, 2, 64), element_size=4) == 2 * 4 * 2 * 64 * 4


def test_peak_bandwidth_by_device_name():
    assert peak_bandwidth_tbps("NVIDIA H200") == 4.8
    assert peak_bandwidth_tbps("NVIDIA H100 80GB HBM3") == 3.35
    assert peak_bandwidth_tbps("NVIDIA H100 PCIe") == 2.0
    assert peak_bandwidth_tbps("Some Future GPU") is None
    assert peak_bandwidth_tbps("NVIDIA H200", override=4.0) == 4.0


def test_decode_grid_drops_shapes_over_the_memory_cap():
    shapes = decode_shapes([64, 128], [4096, 512], LLAMA_8B, element_size=2, max_kv_gib=1.0)
    assert shapes == [DecodeShape(64, 4096), DecodeShape(64, 512), DecodeShape(128, 512)]


def test_markdown_table_reports_percent_of_peak_and_errors():
    rows = [
        dict(batch=64, context=4096, splits=1, triton_ms=0.32, sdpa_ms=0.30, triton_tbps=3.36, sdpa_tbps=3.58),
        dict(batch=256, context=32768, error="OutOfMemoryError"),
    ]
    table = markdown_decode_table(rows, peak_tbps=4.8).splitlines()
    assert table[2] == "| 64 | 4096 | 1 | 0.320 | 0.300 | 1.07x | 3.36 | 70% | 3.58 |"
    assert "OutOfMemoryError" in table[3]
    assert "n/a" in markdown_decode_table(rows[:1], peak_tbps=None)


def test_target_verdict_at_batch_64_4k():
    rows = [
        dict(batch=64, context=4096, triton_ms=0.30, sdpa_ms=0.29, triton_tbps=3.58, sdpa_tbps=3.70),
        dict(batch=1, context=4096, triton_ms=0.02, sdpa_ms=0.01, triton_tbps=0.8, sdpa_tbps=1.6),
    ]
    verdict = target_verdict(rows, peak_tbps=4.8)
    assert verdict["fraction_of_peak"] == pytest.approx(3.58 / 4.8)
    assert verdict["meets_bandwidth"] and verdict["meets_sdpa"]
    slow = [dict(rows[0], triton_ms=0.35, triton_tbps=3.0)]
    verdict = target_verdict(slow, peak_tbps=4.8)
    assert not verdict["meets_bandwidth"] and not verdict["meets_sdpa"]
    assert target_verdict(rows[1:], peak_tbps=4.8) is None
    assert target_verdict(rows, peak_tbps=None)["meets_bandwidth"] is None


@pytest.mark.parametrize("flag", ["--batch-sizes=1,x", "--context-lens=0,512", "--block-size=0", "--block-size=8,16"])
def test_bad_grid_flags_are_usage_errors(flag):
    with pytest.raises(SystemExit):
        _parse([flag])


def test_report_and_summary_with_the_gpu_parts_stubbed(monkeypatch, tmp_path, capsys):
    """What main does with the measurements (no GPU here to make them): the
    JSON report, the table, the target verdict and a failing exit status
    when a correctness case fails."""
    import json

    import engine_pod.attention.triton_backend as triton_backend
    import tessera_tools.bench.kernels as kernels
    from engine_pod.attention.triton_ops.plan import SplitRule

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(triton_backend, "default_split_rule", lambda device: SplitRule(num_sms=132))
    monkeypatch.setattr(kernels, "_correctness", lambda device: [dict(case="a", passed=True),
                                                                dict(case="b", passed=False)])
    decode = [dict(batch=64, context=4096, splits=1, triton_ms=0.3, sdpa_ms=0.29, triton_tbps=3.58, sdpa_tbps=3.7)]
    monkeypatch.setattr(kernels, "_decode_grid", lambda args, heads, device, rule: decode)
    mixed = dict(seqs="64 x (4095 cached + 1)", tokens=64, triton_ms=1.0, torch_backend_ms=5.0, speedup=5.0)
    monkeypatch.setattr(kernels, "_mixed_step", lambda seqs, heads, block_size, device, rule: mixed)
    args = _parse(["--output", str(tmp_path / "k.json")])
    assert args.bench_func(args) == 1  # case b failed
    out = capsys.readouterr().out
    assert "correctness: 1/2 cases pass; FAILED: b" in out
    assert "| 64 | 4096 | 1 | 0.300 | 0.290 | 1.03x | 3.58 | 75% | 3.70 |" in out
    assert "75% of peak (target >= 70%), 1.03x SDPA's time" in out
    report = json.loads((tmp_path / "k.json").read_text())
    assert report["peak_hbm_tbps"] == 4.8 and report["split_rule"]["num_sms"] == 132
    assert report["target"]["meets_bandwidth"] and report["mixed_step"]["speedup"] == 5.0
