"""Adapters read into host memory off the step loop, ``max_cpu_loras`` kept.

A request on an adapter that is not in host memory waits outside the queue
(Scheduler.waiting_for_lora) while a background thread reads the adapter's
files; the steps of every other request go on meanwhile. Only the copy of a
loaded adapter into a model slot rides a step (ModelRunner), a few
megabytes at most.

Everything but the read itself runs on the engine thread, so the host cache
changes only between steps: an adapter the scheduler found ready is still
here when the engine core attaches its weights to the step.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from engine_pod.lora.adapter import AdapterWeights, load_adapter_weights
from engine_pod.lora_request import AdapterSpec

logger = logging.getLogger(__name__)


class LoRALoader:
    """Adapter weights in host memory by adapter id, least recently used first.

    ``in_use`` returns the ids unfinished requests run on: those are never
    evicted, so when all of them are in use the cache holds more than
    ``capacity`` until some finish (a soft limit, not a refusal)."""

    def __init__(self, capacity: int, model_dtype: torch.dtype, in_use: Callable[[], set[int]]) -> None:
        self.capacity = capacity
        self.model_dtype = model_dtype
        self.in_use = in_use
        self._ready: OrderedDict[int, AdapterWeights] = OrderedDict()
        self._reading: dict[int, cf.Future[AdapterWeights]] = {}
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
        # Seconds each adapter's last read took (the load-time metric).
        self.load_seconds: dict[str, float] = {}
        # The ids in host memory, replaced (never mutated) on every change: other
        # threads (the pod's load reports) read it without a lock.
        self.resident_ids: frozenset[int] = frozenset()

    def is_ready(self, spec: AdapterSpec) -> bool:
        lora_id = spec.lora_int_id
        if lora_id in self._ready:
            self._ready.move_to_end(lora_id)
            return True
        future = self._reading.get(lora_id)
        if future is None:
            self._reading[lora_id] = self._pool.submit(self._read, spec)
            return False
        if not future.done():
            return False
        del self._reading[lora_id]
        self._ready[lora_id] = future.result()  # a read that failed raises its ValueError here
        self._evict()
        self.resident_ids = frozenset(self._ready)
        return True

    def wait(self, timeout: float) -> None:
        if self._reading:
            cf.wait(list(self._reading.values()), timeout, return_when=cf.FIRST_COMPLETED)

    def get(self, lora_id: int) -> AdapterWeights:
        return self._ready[lora_id]

    def resident(self) -> list[AdapterSpec]:
        """The adapters in host memory, least recently used first."""
        return [w.spec for w in self._ready.values()]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _read(self, spec: AdapterSpec) -> AdapterWeights:
        start = time.perf_counter()
        weights = load_adapter_weights(spec, self.model_dtype)
        self.load_seconds[spec.name] = time.perf_counter() - start
        logger.info("LoRA adapter %r read in %.1f ms (%.1f MB)", spec.name,
                    1e3 * self.load_seconds[spec.name], weights.nbytes() / 1e6)
        return weights

    def _evict(self) -> None:
        if len(self._ready) <= self.capacity:
            return
        keep = self.in_use()
        for lora_id in list(self._ready):
            if len(self._ready) <= self.capacity:
                break
            if lora_id not in keep:
                del self._ready[lora_id]
