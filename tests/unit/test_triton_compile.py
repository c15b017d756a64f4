"""The triton kernels compile for Hopper (sm_90, the H200) without a GPU:
the interpreter runs the kernels' arithmetic but not triton's GPU compiler,
whose type and layout rules it does not enforce. A subprocess (the suite's
kernels are interpreted) records the launches the backend makes for a
Llama-8B-shaped bfloat16 step with decode splits and a prefill, then
compiles each one, with its exact arguments and launch options, to a cubin."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tessera.fixtures.attention_cases import AttentionCase, TEST_SPLIT_RULE, build_case

HOPPER = ("cuda", 90, 32)


def record_and_compile() -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, mangle_type

    launches = []
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))

    from engine_pod.attention.triton_backend import TritonAttentionBackend

    step = build_case(AttentionCase(16, 32, 8, 128, torch.bfloat16, split=True, seed=0), torch.device("cpu"))
    TritonAttentionBackend(TEST_SPLIT_RULE).forward(
        step.query, step.key, step.value, step.kv_cache, step.metadata, step.scale
    )
    compiled = []
    for fn, args, kwargs in launches:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        signature = {name: mangle_type(arg) for name, arg in zip(fn.arg_names, args)}
        signature.update({name: "constexpr" for name in kwargs})
        source = ASTSource(fn=fn, signature=signature, constexprs=kwargs)
        kernel = triton.compile(source, target=GPUTarget(*HOPPER), options=options)
        assert kernel.asm["cubin"], fn.__name__
        compiled.append(f"{fn.__name__} NUM_SPLITS={kwargs.get('NUM_SPLITS', '-')}")
    return compiled


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.unit.test_triton_compile import record_and_compile; print(*record_and_compile(), sep='\\n')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    launched = result.stdout.split("\n")
    # The cache write, the split decode launch, its reduce, the prefill launch.
    assert [line for line in launched if line] == [
        "_write_kv_kernel NUM_SPLITS=-",
        "_paged_attention_kernel NUM_SPLITS=4",
        "_reduce_splits_kernel NUM_SPLITS=4",
        "_paged_attention_kernel NUM_SPLITS=1",
    ]
