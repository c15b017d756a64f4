"""The sampling parameters' limits: one home for the engine and the gateway.

`ENGINE_RANGES` is what the engine accepts (`engine_pod.SamplingParams`);
it is authoritative. `API_RANGES` is what the gateway's public API accepts:
the same ranges, tightened where the API promises less than the engine can
do (OpenAI's temperature range, a bounded `n`, the wire's integer widths),
and never wider, so an engine pod never refuses what the gateway admitted
(tests/tessera/test_sampling_limits.py checks that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Alternatives per token an engine returns (and the API accepts).
MAX_LOGPROBS = 20
# OpenAI's limit for /v1/completions' `logprobs` (chat's top_logprobs goes to MAX_LOGPROBS).
MAX_COMPLETION_LOGPROBS = 5
# The public API's per-request list sizes.
MAX_N = 16
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 64
# The wire's integer widths (engine.proto / inference.proto): every integer
# a client sends is checked against these at the edge, so no conversion to a
# proto message can overflow inside a request's task.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Range:
    """A closed interval, open at `low` when `low_open`; None: unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        # NaN compares false with everything: never in a range.
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}]"

    def pydantic(self) -> dict[str, float]:
        """The range as pydantic Field bounds (gt/ge, le), for the API's document."""
        bounds: dict[str, float] = {}
        if self.low is not None:
            bounds["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            bounds["le"] = self.high
        return bounds

    def within(self, other: Range) -> bool:
        """Every value of this range is in `other`."""
        low_ok = other.low is None or (self.low is not None and (
            self.low > other.low or (self.low == other.low and (self.low_open or not other.low_open))))
        high_ok = other.high is None or (self.high is not None and self.high <= other.high)
        return low_ok and high_ok


def _number(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


ENGINE_RANGES: dict[str, Range] = {
    "temperature": Range(0.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, low_open=True),
    "n": Range(1),
    "max_tokens": Range(1),
    "min_tokens": Range(0),
    "logprobs": Range(0, MAX_LOGPROBS),
}

API_RANGES: dict[str, Range] = {
    **ENGINE_RANGES,
    # OpenAI's range; the engine samples any temperature >= 0.
    "temperature": Range(0.0, 2.0),
    "repetition_penalty": Range(0.0, 2.0, low_open=True),
    "top_k": Range(-1, INT32_MAX),
    "n": Range(1, MAX_N),
    "max_tokens": Range(1, INT32_MAX),
    "min_tokens": Range(0, INT32_MAX),
    "seed": Range(INT64_MIN, INT64_MAX),
}


def check_range(name: str, value: float | None, ranges: dict[str, Range], where: str = "") -> None:
    """ValueError naming the field (``where`` + name, e.g. "SamplingParams.top_p")
    unless `value` is None or in its range."""
    if value is not None and value not in ranges[name]:
        raise ValueError(f"{where}{name}: must be {ranges[name]}, got {value!r}")
