"""The gateway's own request and output types, between the front ends
(REST, gRPC) and the serving pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.sampling_limits import API_RANGES, INT32_MAX, INT64_MIN, MAX_STOP, MAX_STOP_TOKEN_IDS, check_range
from tessera.structured_output import StructuredOutputsParams, params_to_proto
from tessera.v1 import engine_pb2 as epb


def child_seed(seed: int, index: int) -> int:
    """The seed of the index-th of n choices: `seed + index` wrapped to a
    signed 64-bit integer, so every int64 seed is valid with any n. torch
    reduces seeds modulo 2**64, so a wrapped seed draws exactly what the
    offline LLM's unwrapped `seed + index` draws."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


@dataclass
class SamplingOptions:
    """OpenAI's sampling fields plus vLLM's extensions, already range-checked."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # Already parsed by the front end (gateway/structured_output.py).
    structured_outputs: StructuredOutputsParams | None = None
    # The client's field that carried it (response_format, structured_outputs,
    # guided_json, params.structured_outputs, ...): what an engine pod's
    # refusal of the constraint names.
    structured_outputs_param: str | None = None

    def validate(self) -> None:
        """ValueError naming the field (the front ends check types, this checks
        ranges: the public API's, tessera.sampling_limits.API_RANGES)."""
        for name in API_RANGES:
            check_range(name, getattr(self, name), API_RANGES)
        checks = [
            (len(self.stop) <= MAX_STOP and all(self.stop), "stop", f"at most {MAX_STOP} non-empty strings"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids"),
            (all(0 <= t <= INT32_MAX for t in self.stop_token_ids), "stop_token_ids", "must be token ids (>= 0)"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name}: {rule}")

    def to_engine(self, max_tokens: int, child_index: int) -> epb.SamplingParams:
        # Each of n samples gets its own seed, so seeded samples differ yet
        # stay reproducible (the offline LLM does the same).
        seed = None if self.seed is None else child_seed(self.seed, child_index)
        params = epb.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
        )
        if seed is not None:
            params.seed = seed
        if self.logprobs is not None:
            params.logprobs = self.logprobs
        if self.structured_outputs is not None:
            params.structured_outputs.CopyFrom(params_to_proto(self.structured_outputs))
        return params


@dataclass
class GenerationRequest:
    request_id: str
    model: str
    # Exactly one of these is set by the front end; the pipeline tokenizes.
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    # With messages: the functions the model may call, for the chat template
    # (OpenAI's shape; gateway/tool_calls plans the rest).
    tools: list[dict] | None = None
    options: SamplingOptions = field(default_factory=SamplingOptions)
    priority_class: str | None = None
    user: str | None = None


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    # (token id, token text, logprob) of the top alternatives, best first.
    top: list[tuple[int, str, float]]


@dataclass
class ChoiceUpdate:
    """New output of one choice: a text delta, or its end."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    # The stop string (str) or stop token id (int) that ended the choice.
    stop_reason: str | int | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
