"""The executor interface the engine core calls, whatever the number of workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from engine_pod.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:  # a simulated engine never imports the worker side (torch)
    from engine_pod.worker.stage_timing import StageTiming


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def attach_kv_store(self, store) -> None:
        """Use the KV store: the worker(s) copy loaded blocks in and read
        blocks to save back; the executor puts those into the store."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may have in flight at once (one per pipeline stage;
        1: each step's output is taken before the next is scheduled)."""
        return 1

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step without waiting for it (executors with max_concurrent_batches > 1)."""
        raise NotImplementedError(f"{type(self).__name__} runs one step at a time: call execute_model")

    def take_model_output(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted and not yet taken, waiting for it."""
        raise NotImplementedError(f"{type(self).__name__} runs one step at a time: call execute_model")

    def stage_timings(self) -> list[StageTiming]:
        """Every rank's pipeline-stage figures so far (other nodes' as of their
        last heartbeat), without a call to them: safe from another thread, also
        while steps are in flight; [] where there are none (a simulated engine)."""
        return []

    @abstractmethod
    def collective_rpc(self, method: str, *args) -> list:
        """Run a ModelRunner method on every rank; results in rank order
        (per-rank figures such as ``weight_bytes``)."""

    @property
    @abstractmethod
    def forward_seconds(self) -> float:
        """Time spent in model forwards so far (for efficiency figures)."""

    def shutdown(self) -> None:  # noqa: B027 - optional: executors without processes have nothing to stop
        pass
