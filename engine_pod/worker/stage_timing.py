"""Where a pipeline stage's step time goes: computing, or waiting for another
stage (the hidden states from the one before it, the sampled tokens from the
last one). With one batch in flight the stages take turns, so each waits
about (S - 1) / S of a step: the pipeline's bubble."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageTiming:
    """One rank's totals since it started (ModelRunner.stage_timing)."""

    stage: int
    """Its pipeline stage (0 without pipeline parallelism)."""
    tp_rank: int
    """Its rank within the stage's tensor-parallel group."""
    steps: int
    """Non-empty steps it ran."""
    step_seconds: float
    """Wall time inside those steps."""
    wait_seconds: float
    """Of which blocked on another stage (or, at TP rank > 0, on the sampled tokens)."""

    @property
    def busy_seconds(self) -> float:
        return self.step_seconds - self.wait_seconds

    def since(self, earlier: StageTiming) -> StageTiming:
        """The figures of the interval between `earlier` and this reading."""
        return StageTiming(self.stage, self.tp_rank, self.steps - earlier.steps,
                           self.step_seconds - earlier.step_seconds, self.wait_seconds - earlier.wait_seconds)


def stage_leaders(timings: Sequence[StageTiming]) -> list[StageTiming]:
    """Each stage's TP rank 0, in stage order (its ranks compute the same shares)."""
    return sorted((t for t in timings if t.tp_rank == 0), key=lambda t: t.stage)


def bubble_fraction(timings: Sequence[StageTiming], wall_seconds: float) -> float:
    """The share of the stages' time over `wall_seconds` spent not computing:
    1 - (sum of each stage's busy seconds) / (stages x wall)."""
    leaders = stage_leaders(timings)
    if not leaders or wall_seconds <= 0:
        raise ValueError("bubble_fraction needs at least one stage and a positive wall time")
    return 1.0 - sum(t.busy_seconds for t in leaders) / (len(leaders) * wall_seconds)
