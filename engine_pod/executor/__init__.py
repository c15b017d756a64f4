"""Executors: how the engine core reaches its worker(s)."""

from __future__ import annotations

from engine_pod.config import EngineConfig
from engine_pod.executor.abstract import Executor


def create_executor(config: EngineConfig) -> Executor:
    """In process at TP=PP=1; one worker process per rank above. Imported here:
    the model runner needs torch, which a simulated pod never loads."""
    if config.parallel.world_size == 1:
        from engine_pod.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    from engine_pod.executor.multiproc import MultiProcExecutor

    return MultiProcExecutor(config)


__all__ = ["Executor", "create_executor"]
