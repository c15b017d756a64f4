"""The triton kernels compile for Hopper (sm_90, the H200) without a GPU:
the interpreter runs the kernels' arithmetic but not triton's GPU compiler,
whose type and layout rules it does not enforce. A subprocess (the suite's
kernels are interpreted) records the launches the backend makes for
Llama-8B-shaped bfloat16 steps with decode splits and a prefill, then
compiles each distinct one, with its exact argument types, compile-time
constants and launch options, to a cubin."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from engine_pod.attention.triton_ops.plan import SplitRule
from tessera_tools.fixtures.attention_cases import TEST_SPLIT_RULE, AttentionCase, build_case

HOPPER = ("cuda", 90, 32)


def _record_launches(case: AttentionCase, rule: SplitRule) -> list[tuple]:
    """(kernel, signature, constants, options) of each launch of one step."""
    from triton.runtime.jit import JITFunction, mangle_type

    from engine_pod.attention.triton_backend import TritonAttentionBackend

    launches = []
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    step = build_case(case, torch.device("cpu"))
    TritonAttentionBackend(rule).forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, step.scale
    )
    recorded = []
    for fn, args, kwargs in launches:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        signature = {name: mangle_type(arg) for name, arg in zip(fn.arg_names, args)}
        signature.update({name: "constexpr" for name in kwargs})
        recorded.append((fn, signature, kwargs, options, args))
    return recorded


def record_and_compile() -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    llama_8b = AttentionCase(16, 32, 8, 128, torch.bfloat16, split=True, seed=0)
    first = _record_launches(llama_8b, TEST_SPLIT_RULE)
    # The same shapes split another number of ways (a device with fewer
    # multiprocessors): what would a step with another count recompile?
    second = _record_launches(llama_8b, SplitRule(num_sms=33, min_keys_per_split=16))

    lines = []
    for fn, signature, constants, options, _ in first:
        source = ASTSource(fn=fn, signature=signature, constexprs=constants)
        kernel = triton.compile(source, target=GPUTarget(*HOPPER), options=options)
        assert kernel.asm["cubin"], fn.__name__
        lines.append(f"{fn.__name__} SPLIT={constants.get('SPLIT', '-')}")
    splits = [launch[4][fn_arg_index(launch[0], "num_splits")] for launch in (first[1], second[1])]
    lines.append(f"split counts: {splits}")
    for a, b in zip(first, second):
        changed = sorted(k for k in a[2] if a[2][k] != b[2][k])
        lines.append(f"{a[0].__name__} recompiles for: {changed or 'nothing'}, types equal: {a[1] == b[1]}")
    return lines


def fn_arg_index(fn, name: str) -> int:
    return fn.arg_names.index(name)


def test_kernels_compile_for_hopper_and_split_counts_need_no_recompile():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from tests.engine_pod.attention.test_triton_compile import record_and_compile; "
            "print(*record_and_compile(), sep='\\n')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # The cache write, the split decode launch, its reduce, the prefill launch.
    assert [line for line in result.stdout.split("\n") if line] == [
        "_write_kv_kernel SPLIT=-",
        "_paged_attention_kernel SPLIT=True",
        "_reduce_splits_kernel SPLIT=-",
        "_paged_attention_kernel SPLIT=False",
        "split counts: [4, 3]",
        "_write_kv_kernel recompiles for: nothing, types equal: True",
        "_paged_attention_kernel recompiles for: nothing, types equal: True",
        # The reduce pads the count to a power of two (4 for both): it
        # compiles once per power of two, a handful of variants at most.
        "_reduce_splits_kernel recompiles for: nothing, types equal: True",
        "_paged_attention_kernel recompiles for: nothing, types equal: True",
    ]
