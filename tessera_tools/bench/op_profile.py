"""Where an engine's time goes, by kind of operator: one call run under torch's profiler, each
operator's self CPU time summed into the categories issue 19 compares (GEMMs, attention, the
element-wise work of norms, rotary embedding and activations, KV cache writes, sampling), for
Tessera's operators and vLLM's alike.

Self time, so nothing counts twice. The profiler sees the operators the calling thread runs;
the wall time beyond their sum is Python, scheduling and the profiler's own cost (which makes
it larger than it is without the profiler)."""

from __future__ import annotations

import time
from collections.abc import Callable

# Operator name fragments -> category, first match wins (names as the profiler reports them).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kv cache writes and gathers", ("index_copy", "index_select", "aten::index", "reshape_and_cache",
                                     "kv_cache_update")),
    ("gemm", ("linear", "addmm", "::mm", "onednn_mm", "matmul", "bmm")),
    ("attention", ("paged_decode", "scaled_dot_product", "flash_attention", "attention", "softmax")),
    ("sampling", ("argmax", "topk", "sort", "multinomial", "cumsum")),
    # torch.compile's generated code (vLLM's fused norms, rotary and activations on CPU).
    ("compiled graphs", ("CompiledFxGraph", "Pregraph", "Torch-Compiled")),
    ("norms, rotary, activations, casts", ("mul", "add", "silu", "gelu", "pow", "mean", "rsqrt", "neg", "cat",
                                            "div", "copy_", "_to_copy", "sub", "exp", "sum", "clamp")),
)
OTHER = "other"


def category(op_name: str) -> str:
    for name, fragments in CATEGORIES:
        if any(f in op_name for f in fragments):
            return name
    return OTHER


def profile_ops(fn: Callable[[], object], top: int = 15) -> dict:
    """Run `fn` once under the profiler: seconds per category, the `top` operators by self
    time, and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    wall = time.perf_counter() - start
    return summarize([(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()], wall, top)


def summarize(ops: list[tuple[str, float, int]], wall: float, top: int = 15) -> dict:
    """Operators (name, self seconds, calls) -> the figures of `profile_ops` (a peer's, too)."""
    by_category: dict[str, float] = {}
    for name, seconds, _ in ops:
        kind = category(name)
        by_category[kind] = by_category.get(kind, 0.0) + seconds
    profiled = sum(by_category.values())
    ops = sorted(ops, key=lambda op: op[1], reverse=True)
    return {
        "wall_s": wall, "operators_s": profiled, "outside_operators_s": max(0.0, wall - profiled),
        "by_category_s": dict(sorted(by_category.items(), key=lambda kv: kv[1], reverse=True)),
        "top_operators": [{"name": n, "self_s": s, "calls": c} for n, s, c in ops[:top]],
    }


def describe(profile: dict) -> str:
    total = profile["operators_s"] or 1.0
    lines = [f"{name}: {seconds:.2f} s ({seconds / total:.0%})" for name, seconds in profile["by_category_s"].items()]
    lines.append(f"operators {profile['operators_s']:.2f} s of {profile['wall_s']:.2f} s wall (with the profiler)")
    return "\n".join(lines)
