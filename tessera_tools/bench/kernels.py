"""``tessera bench kernels``: the triton attention kernels on a CUDA device.

Three parts, one JSON report:
- correctness: the CPU test suite's randomized cases (tessera_tools.fixtures.
  attention_cases), now compiled for the GPU, against the torch backend and
  a float64 reference;
- decode attention (Llama-8B heads: 32 query, 8 KV, dim 128; bf16) over a
  grid of batch sizes and context lengths, the triton backend's attention
  over a scattered paged cache against ``scaled_dot_product_attention`` on
  the same K/V laid out contiguously ([B, Hkv, L, D]; each KV head's query
  heads as its query rows, so no K/V copies per query head),
  with the K/V bytes each reads per second next to the device's peak;
- one mixed step (decodes with long contexts plus prefill chunks over cached
  prefixes), the triton backend against the torch backend, cache write
  included.

Times are medians of ``triton.testing.do_bench`` (CUDA events, warm-up, L2
flushed between repetitions). The step's launch plan is built before timing,
as the engine builds it once per step for all layers.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial

import torch

from tessera_tools.bench.common import markdown_table, write_report
from tessera_tools.bench.flags import add_output_arg, positive_float, positive_int, positive_int_list

# Vendor datasheet HBM bandwidth (TB/s) by device-name fragment, most
# specific first.
PEAK_HBM_TBPS = (
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100 NVL", 3.9),
    ("H100", 3.35),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),
    ("L40S", 0.864),
)


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    context: int


@dataclass(frozen=True)
class Heads:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128


def peak_bandwidth_tbps(device_name: str, override: float | None = None) -> float | None:
    if override is not None:
        return override
    return next((tbps for fragment, tbps in PEAK_HBM_TBPS if fragment in device_name), None)


def kv_bytes_read(seq_lens, heads: Heads, element_size: int) -> int:
    """Bytes of K and V a decode step must read: every context token's K and
    V rows for every KV head."""
    return 2 * int(sum(seq_lens)) * heads.num_kv_heads * heads.head_dim * element_size


def decode_shapes(batches: list[int], contexts: list[int], heads: Heads, element_size: int,
                  max_kv_gib: float) -> list[DecodeShape]:
    """The grid, less the shapes whose K/V alone exceed ``max_kv_gib``."""
    limit = max_kv_gib * 2**30
    return [
        DecodeShape(b, c) for b in batches for c in contexts
        if kv_bytes_read([c] * b, heads, element_size) <= limit
    ]


DECODE_COLUMNS = ("batch", "context", "splits", "triton ms", "SDPA ms", "triton / SDPA", "triton TB/s", "% of peak",
                  "SDPA TB/s")


def _decode_cells(r: dict, peak_tbps: float | None) -> list:
    if "error" in r:
        return [r["batch"], r["context"], "", r["error"], *[""] * (len(DECODE_COLUMNS) - 4)]
    pct = f"{100 * r['triton_tbps'] / peak_tbps:.0f}%" if peak_tbps else "n/a"
    return [r["batch"], r["context"], r["splits"], f"{r['triton_ms']:.3f}", f"{r['sdpa_ms']:.3f}",
            f"{r['triton_ms'] / r['sdpa_ms']:.2f}x", f"{r['triton_tbps']:.2f}", pct, f"{r['sdpa_tbps']:.2f}"]


def markdown_decode_table(rows: list[dict], peak_tbps: float | None) -> str:
    return markdown_table(DECODE_COLUMNS, (_decode_cells(r, peak_tbps) for r in rows), align="---:")


# The acceptance targets (issue 9), on an H200.
TARGET_SHAPE = DecodeShape(batch=64, context=4096)
TARGET_FRACTION_OF_PEAK = 0.70
TARGET_MAX_SDPA_RATIO = 1.1


def target_verdict(rows: list[dict], peak_tbps: float | None) -> dict | None:
    """The target shape's fraction of peak and time relative to SDPA, and
    whether each meets its target; None when the shape was not measured."""
    row = next((r for r in rows if (r["batch"], r["context"]) == (TARGET_SHAPE.batch, TARGET_SHAPE.context)
                and "error" not in r), None)
    if row is None:
        return None
    fraction = row["triton_tbps"] / peak_tbps if peak_tbps else None
    ratio = row["triton_ms"] / row["sdpa_ms"]
    return dict(batch=row["batch"], context=row["context"], fraction_of_peak=fraction, sdpa_ratio=ratio,
                meets_bandwidth=None if fraction is None else fraction >= TARGET_FRACTION_OF_PEAK,
                meets_sdpa=ratio <= TARGET_MAX_SDPA_RATIO)


# -- GPU parts -------------------------------------------------------------

def _median_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _correctness(device: torch.device) -> list[dict]:
    from tessera_tools.fixtures.attention_cases import CORRECTNESS_CASES, run_case

    results = []
    for case in CORRECTNESS_CASES:
        r = run_case(case, device)
        results.append(dict(case=case.id, passed=r.passed, splits=r.num_splits, cache_equal=r.cache_equal,
                            err_vs_torch=r.err_vs_torch, err_vs_reference=r.err_vs_reference))
    return results


def _paged_step(seqs, heads: Heads, block_size: int, dtype, device):
    """A step over a scattered paged cache filled on the device."""
    from tessera_tools.fixtures.attention_cases import make_step, move_metadata

    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs)
    md, tables = make_step(seqs, block_size, heads.num_kv_heads, heads.head_dim, num_blocks,
                           torch.Generator().manual_seed(0))
    cache = torch.randn(2, num_blocks, block_size, heads.num_kv_heads, heads.head_dim, dtype=dtype, device=device)
    return move_metadata(md, device), tables, cache


def _contiguous(cache_half: torch.Tensor, table: torch.Tensor, context: int) -> torch.Tensor:
    """[B, Hkv, L, D] copy of one of K or V, for SDPA."""
    rows = cache_half[table].flatten(1, 2)[:, :context]  # [B, L, Hkv, D]
    return rows.transpose(1, 2).contiguous()


def _decode_row(shape: DecodeShape, heads: Heads, block_size: int, dtype, device, rule) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from engine_pod.attention.triton_backend import TritonAttentionBackend

    md, _, cache = _paged_step([(shape.context - 1, 1)] * shape.batch, heads, block_size, dtype, device)
    scale = heads.head_dim**-0.5
    q = torch.randn(shape.batch, heads.num_heads, heads.head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    backend = TritonAttentionBackend(rule)
    backend.attend(out, q, cache, md, scale)  # plans the step and compiles
    splits = md.backend_cache["triton_launches"][0].plan.num_splits
    triton_ms = _median_ms(partial(backend.attend, out, q, cache, md, scale))
    k = _contiguous(cache[0], md.block_table, shape.context)
    v = _contiguous(cache[1], md.block_table, shape.context)
    del cache  # the contiguous copies take its place
    # One query token per sequence: the GQA group's query heads become the
    # query rows of their KV head, with no mask, so SDPA reads each K/V row
    # once (no copies per query head, no enable_gqa needed).
    group = heads.num_heads // heads.num_kv_heads
    q_rows = q.view(shape.batch, heads.num_kv_heads, group, heads.head_dim)
    # The fused kernels only: the math fallback would materialise the scores.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        def sdpa():
            return F.scaled_dot_product_attention(q_rows, k, v, scale=scale)

        expected = sdpa().reshape(shape.batch, heads.num_heads, heads.head_dim)
        sdpa_ms = _median_ms(sdpa)
    nbytes = kv_bytes_read(md.seq_lens_cpu, heads, q.element_size())
    return dict(
        batch=shape.batch, context=shape.context, splits=splits, triton_ms=triton_ms, sdpa_ms=sdpa_ms,
        triton_tbps=nbytes / triton_ms / 1e9, sdpa_tbps=nbytes / sdpa_ms / 1e9, kv_bytes=nbytes,
        max_abs_diff_vs_sdpa=float((out.float() - expected.float()).abs().max()),
    )


def _decode_grid(args, heads: Heads, device, rule) -> list[dict]:
    shapes = decode_shapes(args.batch_sizes, args.context_lens, heads, 2, args.max_kv_gib)
    rows = []
    for shape in shapes:
        try:
            rows.append(_decode_row(shape, heads, args.block_size, torch.bfloat16, device, rule))
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            rows.append(dict(batch=shape.batch, context=shape.context, error=type(e).__name__,
                             error_message=str(e)[:500]))
        torch.cuda.empty_cache()
        print(f"decode batch={shape.batch} context={shape.context}: {rows[-1]}", file=sys.stderr)
    return rows


# 64 decodes at 4k context, two 512-token chunks after 1k cached tokens
# (chunked prefill), one fresh 1k-token prefill: (num_cached, num_new).
MIXED_STEP = [(4095, 1)] * 64 + [(1024, 512)] * 2 + [(0, 1024)]


def _mixed_step(seqs, heads: Heads, block_size: int, device, rule) -> dict:
    from engine_pod.attention.torch_backend import TorchAttentionBackend
    from engine_pod.attention.triton_backend import TritonAttentionBackend

    md, _, cache = _paged_step(seqs, heads, block_size, torch.bfloat16, device)
    T = md.num_actual_tokens
    q = torch.randn(T, heads.num_heads, heads.head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(T, heads.num_kv_heads, heads.head_dim, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    scale = heads.head_dim**-0.5
    triton_backend, torch_backend = TritonAttentionBackend(rule), TorchAttentionBackend()
    got = triton_backend.forward(q, k, v, cache, md, scale)
    expected = torch_backend.forward(q, k, v, cache, md, scale)
    triton_ms = _median_ms(lambda: triton_backend.forward(q, k, v, cache, md, scale))
    torch_ms = _median_ms(lambda: torch_backend.forward(q, k, v, cache, md, scale))
    described = ", ".join(f"{n} x ({c} cached + {new})" for (c, new), n in Counter(seqs).items())
    return dict(seqs=described, tokens=T,
                triton_ms=triton_ms, torch_backend_ms=torch_ms, speedup=torch_ms / triton_ms,
                max_abs_diff_vs_torch=float((got.float() - expected.float()).abs().max()))


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("tessera bench kernels needs a CUDA device and found none; on CPU the kernels are checked by "
              "tests/engine_pod/attention/test_triton_attention.py under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    from engine_pod.attention.triton_backend import default_split_rule

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = peak_bandwidth_tbps(name, args.peak_bandwidth_tbps)
    heads, rule = Heads(), default_split_rule(device)
    report = dict(device=name, peak_hbm_tbps=peak, heads=asdict(heads), block_size=args.block_size,
                  split_rule=asdict(rule))
    report["correctness"] = _correctness(device)
    failed = [r["case"] for r in report["correctness"] if not r["passed"]]
    print(f"correctness: {len(report['correctness']) - len(failed)}/{len(report['correctness'])} cases pass"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    report["decode"] = _decode_grid(args, heads, device, rule)
    report["mixed_step"] = _mixed_step(MIXED_STEP, heads, args.block_size, device, rule)
    print(f"\n{name}, peak HBM {peak if peak else 'unknown (pass --peak-bandwidth-tbps)'} TB/s, bf16, "
          f"{heads.num_heads} query / {heads.num_kv_heads} KV heads, head dim {heads.head_dim}, "
          f"block size {args.block_size}\n")
    print(markdown_decode_table(report["decode"], peak))
    verdict = report["target"] = target_verdict(report["decode"], peak)
    if verdict:
        fraction = "n/a" if verdict["fraction_of_peak"] is None else f"{verdict['fraction_of_peak']:.0%}"
        print(f"\ntarget at batch {verdict['batch']} x {verdict['context']}: {fraction} of peak "
              f"(target >= {TARGET_FRACTION_OF_PEAK:.0%}), {verdict['sdpa_ratio']:.2f}x SDPA's time "
              f"(target <= {TARGET_MAX_SDPA_RATIO}x)")
    m = report["mixed_step"]
    print(f"\nmixed step ({m['tokens']} tokens: {m['seqs']}): triton {m['triton_ms']:.3f} ms, "
          f"torch backend {m['torch_backend_ms']:.3f} ms ({m['speedup']:.1f}x)")
    write_report(report, args.output)
    return 1 if failed else 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("kernels", help="triton attention kernels on CUDA: correctness, decode vs SDPA, mixed step")
    p.add_argument("--batch-sizes", type=positive_int_list, default=[1, 4, 16, 64, 128, 256])
    p.add_argument("--context-lens", type=positive_int_list, default=[512, 2048, 4096, 8192, 32768])
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--max-kv-gib", type=positive_float, default=40.0,
                   help="skip decode shapes whose K/V exceed this (SDPA's contiguous copy doubles it)")
    p.add_argument("--peak-bandwidth-tbps", type=positive_float, default=None,
                   help="the device's peak HBM bandwidth in TB/s (default: looked up by device name)")
    add_output_arg(p, default="bench-results/kernels.json")
    p.set_defaults(bench_func=main)
