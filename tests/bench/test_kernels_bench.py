"""`tessera bench kernels`: its refusal without CUDA and the pure helpers
behind its figures (the GPU parts run on a CUDA machine only)."""

from __future__ import annotations

import argparse

import pytest
import torch

from tessera.bench.kernels import (
    DecodeShape, Heads, add_parser, decode_shapes, kv_bytes_read, markdown_decode_table, peak_bandwidth_tbps,
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


@pytest.mark.parametrize("flag", ["--batch-sizes=1,x", "--context-lens=0,512"])
def test_bad_grid_flags_are_usage_errors(flag):
    with pytest.raises(SystemExit):
        _parse([flag])
