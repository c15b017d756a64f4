"""Where a pipeline stage's time goes: computing, or waiting within a step for
the previous stage's hidden states or for the next stage to take its own; the
time between steps (waiting for the
engine's next one) is the rest. With one step in flight the stages would take
turns and each idle about (S - 1) / S of the time; the engine keeps one step
per stage in flight to hide that bubble, and these figures say how far it
does."""

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
    """Of which blocked on another stage: receiving the previous one's hidden
    states, or handing this one's to the next."""

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


class StageTimingBoard:
    """Every local rank's StageTiming totals in shared memory: each worker
    writes its row after each step, and the engine's process reads them at any
    time (a metrics scrape) without a call to the workers, which may be busy
    with steps in flight."""

    FIELDS = 3  # steps, step seconds, wait seconds

    def __init__(self, ctx, world_size: int, tp_size: int) -> None:
        """``ctx``: the multiprocessing context the workers are spawned with."""
        self._values = ctx.Array("d", world_size * self.FIELDS)
        self.tp_size = tp_size

    def publish(self, rank: int, timing: StageTiming) -> None:
        row = rank * self.FIELDS
        with self._values.get_lock():  # a reader never sees half a row
            self._values[row:row + self.FIELDS] = [timing.steps, timing.step_seconds, timing.wait_seconds]

    def read(self, ranks: range) -> list[StageTiming]:
        """The totals of ``ranks`` (this node's), as their workers last wrote them."""
        with self._values.get_lock():
            values = list(self._values)
        timings = []
        for rank in ranks:
            steps, step_seconds, wait_seconds = values[rank * self.FIELDS:(rank + 1) * self.FIELDS]
            timings.append(StageTiming(rank // self.tp_size, rank % self.tp_size, int(steps), step_seconds,
                                       wait_seconds))
        return timings
