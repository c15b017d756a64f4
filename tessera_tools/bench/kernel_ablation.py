"""``tessera bench throughput --ablate KERNEL``: one CPU kernel measured on its own in the engine.

One loaded engine runs the throughput workload in alternated rounds with the kernel switched
off and on (off, on, off, ...), so both meet the same noise of a shared machine; the figure is
the ratio of the two sides' median output tokens per second, and the report counts the requests
whose greedy outputs are identical both ways.

- ``layer-kernels``: the layers' element-wise kernels (RMSNorm with the residual add, rotary,
  SiLU-times-up; attention/cpu_ops/fused_layers.cpp) against torch's operators;
- ``prefill-kernel``: prefill attention as the cpu backend's GEMMs
  (attention/cpu_ops/prefill_attention.cpp) against the torch backend's SDPA.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import contextmanager

from engine_pod import LLM
from tessera_tools.bench.workload import BenchRequest

ABLATIONS = ("layer-kernels", "prefill-kernel")


@contextmanager
def kernel_switched_off(llm: LLM, kernel: str):
    """Within the block the engine runs without `kernel`; restored after."""
    if kernel == "layer-kernels":
        modules = [m for m in llm.engine_core.executor.runner.model.modules() if getattr(m, "cpu_kernels", False)]
        if not modules:
            raise ValueError("--ablate layer-kernels: this engine does not run the layers' CPU kernels "
                             "(they need the cpu attention backend and a float32/bf16/fp16 model)")
        for module in modules:
            module.cpu_kernels = False
        try:
            yield
        finally:
            for module in modules:
                module.cpu_kernels = True
        return
    from engine_pod.attention.cpu_backend import CpuAttentionBackend

    backend = llm.engine_core.executor.runner.backend
    if not isinstance(backend, CpuAttentionBackend):
        raise ValueError(f"--ablate prefill-kernel: this engine runs the {backend.name} attention backend, not cpu")
    before, backend.prefill_kernels = backend.prefill_kernels, False
    try:
        yield
    finally:
        backend.prefill_kernels = before


def ablate(llm: LLM, requests: list[BenchRequest], kernel: str, rounds: int, generate: Callable) -> dict:
    """`generate(llm, requests)` -> (EngineRunResult, token ids): one timed round."""
    tps: dict[str, list[float]] = {"off": [], "on": []}
    outputs: dict[str, list[list[int]]] = {}
    for round_index in range(rounds):
        for side in ("off", "on"):
            if side == "off":
                with kernel_switched_off(llm, kernel):
                    result, tokens = generate(llm, requests)
            else:
                result, tokens = generate(llm, requests)
            tps[side].append(result.tokens_per_second)
            outputs.setdefault(side, tokens)
            print(f"round {round_index + 1}/{rounds}: {kernel} {side}: {result.tokens_per_second:.1f} tok/s",
                  flush=True)
    on, off = statistics.median(tps["on"]), statistics.median(tps["off"])
    identical = sum(a == b for a, b in zip(outputs["on"], outputs["off"]))
    print(f"{kernel} on / off (ratio of medians): {on / off:.3f}x ({on:.1f} vs {off:.1f} tok/s); "
          f"greedy outputs identical both ways: {identical} of {len(requests)}")
    return {"ablation": {"kernel": kernel, "rounds": rounds, "on_tokens_per_second": tps["on"],
                         "off_tokens_per_second": tps["off"], "on_median": on, "off_median": off,
                         "ratio_of_medians": on / off, "identical_outputs": identical,
                         "requests": len(requests)}}
