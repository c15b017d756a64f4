"""Executors: how the engine core reaches its worker(s)."""

from engine_pod.executor.abstract import Executor
from engine_pod.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
