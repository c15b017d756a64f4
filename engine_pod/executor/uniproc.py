"""One worker in the engine core's own process (tensor parallel size 1)."""

from __future__ import annotations

from engine_pod.config import EngineConfig
from engine_pod.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine_pod.executor.abstract import Executor
from engine_pod.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def attach_kv_store(self, store) -> None:
        self.runner.attach_kv_store(store)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def collective_rpc(self, method: str, *args) -> list:
        return [getattr(self.runner, method)(*args)]

    @property
    def forward_seconds(self) -> float:
        return self.runner.forward_seconds
