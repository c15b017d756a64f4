"""Executors: how the engine core reaches its worker(s)."""

from engine_pod.config import EngineConfig
from engine_pod.executor.abstract import Executor
from engine_pod.executor.uniproc import UniProcExecutor


def create_executor(config: EngineConfig) -> Executor:
    """In process at TP=1; one worker process per rank above."""
    if config.parallel.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    from engine_pod.executor.multiproc import MultiProcExecutor

    return MultiProcExecutor(config)


__all__ = ["Executor", "UniProcExecutor", "create_executor"]
