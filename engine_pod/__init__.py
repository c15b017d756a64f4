"""Engine pod: paged-attention engine core, model runner and offline API.

    from engine_pod import LLM, SamplingParams
"""

from engine_pod.entrypoints.llm import LLM
from engine_pod.outputs import CompletionOutput, Logprob, RequestOutput
from engine_pod.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
