"""``tessera bench throughput --step-breakdown``: one generate's engine steps
grouped by what they computed, with the time each group took.

A step that computes any prefill tokens (decodes riding along or not) is a
prefill step; the others are decode-only steps, grouped by how many
sequences they decode (1, 2, 3-4, 5-8, ... up to a power of two). On a CPU
the groups run at very different rates: a prefill step's GEMMs have
thousands of rows, a decode step's as many as it has sequences, and the
last steps of a long-tailed batch decode a few sequences while streaming
every weight. The seconds are the executor's (the forward and sampling),
as EngineCore's step_observer sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from engine_pod.sim.step_profile import StepFeatures

PREFILL = "prefill"


@dataclass
class StepGroup:
    """The steps of one kind in a run."""

    kind: str
    """"prefill", or "decode N-M": decode-only steps of N to M sequences."""
    steps: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    """Sequences decoded, summed over the steps (one token each, drafts aside)."""

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps

    @property
    def mean_decodes(self) -> float:
        return self.decode_seqs / self.steps


def group_of(features: StepFeatures) -> tuple[int, str]:
    """(sort key, kind) of a step: prefill first, then decode-only steps by batch size."""
    if features.num_prefill_tokens > 0:
        return 0, PREFILL
    decodes = max(1, features.num_decode_seqs)
    high = 1 << (decodes - 1).bit_length()  # the power of two at or above it
    low = high // 2 + 1 if high > 1 else 1
    return high, f"decode {low}-{high}" if low < high else f"decode {high}"


def summarise(samples: Sequence[tuple[StepFeatures, float]]) -> list[StepGroup]:
    """The steps' (features, seconds) grouped, prefill first, then by decode batch size."""
    groups: dict[tuple[int, str], StepGroup] = {}
    for features, seconds in samples:
        key = group_of(features)
        group = groups.setdefault(key, StepGroup(key[1]))
        group.steps += 1
        group.seconds += seconds
        group.prefill_tokens += features.num_prefill_tokens
        group.decode_seqs += features.num_decode_seqs
    return [groups[key] for key in sorted(groups)]


def describe(groups: Sequence[StepGroup]) -> str:
    total = sum(g.seconds for g in groups) or 1.0
    lines = [f"{'steps':<14} {'count':>5} {'seconds':>8} {'share':>6} {'ms/step':>8} {'prefill tok':>11} "
             f"{'decodes/step':>12}"]
    for g in groups:
        lines.append(f"{g.kind:<14} {g.steps:>5} {g.seconds:>8.2f} {g.seconds / total:>6.1%} {g.ms_per_step:>8.1f} "
                     f"{g.prefill_tokens:>11} {g.mean_decodes:>12.1f}")
    return "\n".join(lines)


def as_report(groups: Sequence[StepGroup]) -> list[dict]:
    return [{**asdict(g), "ms_per_step": g.ms_per_step, "mean_decodes": g.mean_decodes} for g in groups]
