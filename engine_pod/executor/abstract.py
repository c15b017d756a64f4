"""The executor interface the engine core calls, whatever the number of workers."""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine_pod.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


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
