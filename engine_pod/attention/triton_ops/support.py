"""What the triton backend runs on, decided without importing a kernel."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

SUPPORTED_HEAD_SIZES = (64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KERNEL_MODULES = tuple(
    f"engine_pod.attention.triton_ops.{m}" for m in ("cache_write", "paged_attention", "reduce_splits")
)


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_unsupported_reason(device: torch.device, head_size: int, dtype: torch.dtype) -> str | None:
    """Why the triton backend cannot run this model here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if device.type == "cpu":
        if not interpreter_enabled():
            return "triton kernels run on CUDA, or on CPU only under the interpreter (set TRITON_INTERPRET=1)"
        # Triton read TRITON_INTERPRET when the kernels were decorated: a
        # module imported before it was set holds GPU kernels.
        if any(m in sys.modules for m in KERNEL_MODULES) and not _kernels_interpreted():
            return "the triton kernels were imported before TRITON_INTERPRET=1 was set; set it before starting"
    elif device.type != "cuda":
        return f"triton kernels do not run on device type {device.type!r}"
    elif interpreter_enabled():
        return "TRITON_INTERPRET=1 is set: the kernels would run in the CPU interpreter, not on the GPU"
    if head_size not in SUPPORTED_HEAD_SIZES:
        return f"head size {head_size} is not supported (supported: {', '.join(map(str, SUPPORTED_HEAD_SIZES))})"
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        return f"dtype {str(dtype).removeprefix('torch.')} is not supported (supported: {names})"
    return None


def _kernels_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    loaded = [sys.modules[m] for m in KERNEL_MODULES if m in sys.modules]
    kernels = [v for mod in loaded for name, v in vars(mod).items() if name.endswith("_kernel")]
    return all(isinstance(k, InterpretedFunction) for k in kernels)
