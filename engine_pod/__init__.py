"""Engine pod: paged-attention engine core, model runner and offline API.

    from engine_pod import LLM, SamplingParams

The names below are imported on first use (PEP 562), not with the package:
every module of ``engine_pod`` imports this file first, and a simulated pod
(engine_pod/sim) runs the scheduler without the torch that ``LLM`` needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_pod.entrypoints.llm import LLM
    from engine_pod.lora_request import LoRARequest
    from engine_pod.outputs import CompletionOutput, Logprob, RequestOutput
    from engine_pod.sampling_params import SamplingParams

_HOME = {
    "LLM": "engine_pod.entrypoints.llm",
    "SamplingParams": "engine_pod.sampling_params",
    "RequestOutput": "engine_pod.outputs",
    "CompletionOutput": "engine_pod.outputs",
    "Logprob": "engine_pod.outputs",
    "LoRARequest": "engine_pod.lora_request",
}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "LoRARequest"]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_pod' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
