"""One worker in the engine core's own process (tensor parallel size 1)."""

from __future__ import annotations

from engine_pod.config import EngineConfig
from engine_pod.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine_pod.executor.abstract import Executor
from engine_pod.executor.kv_store_writer import put_step_blocks
from engine_pod.worker.model_runner import ModelRunner
from kv_store.tiered_store import TieredKVStore


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        self.kv_store: TieredKVStore | None = None

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def attach_kv_store(self, store: TieredKVStore) -> None:
        self.kv_store = store
        self.runner.attach_kv_store(store.codec.layout)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = self.runner.execute_model(scheduler_output)
        if out.kv_connector_output is not None:
            assert self.kv_store is not None and scheduler_output.kv_connector is not None
            put_step_blocks(self.kv_store, scheduler_output.kv_connector, [out.kv_connector_output])
            out.kv_connector_output = None
        return out

    def stage_timings(self) -> list:
        return [self.runner.stage_timing()]

    def collective_rpc(self, method: str, *args) -> list:
        return [getattr(self.runner, method)(*args)]

    @property
    def forward_seconds(self) -> float:
        return self.runner.forward_seconds
