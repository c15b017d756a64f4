"""Adapters read into host memory off the step loop, ``max_cpu_loras`` kept.

A request on an adapter that is not in host memory waits outside the queue
(Scheduler.waiting_for_lora) while a background thread reads the adapter's
files; the steps of every other request go on meanwhile. Only the copy of a
loaded adapter into a model slot rides a step (ModelRunner), a few
megabytes at most.

Everything but the read itself runs on the engine thread, so the host cache
changes only between steps: an adapter the scheduler found ready is still
here when the engine core attaches its weights to the step.

A read that outlives ``read_timeout_s`` (a hung network volume) is given up:
its requests end with the cause, the reader thread is left to its read and
a new one takes the reads queued behind it; the adapter is refused for as
long again before it is read anew.
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

    def __init__(self, capacity: int, model_dtype: torch.dtype, in_use: Callable[[], set[int]],
                 read_timeout_s: float = 120.0) -> None:
        self.capacity = capacity
        self.model_dtype = model_dtype
        self.in_use = in_use
        self.read_timeout_s = read_timeout_s
        self._ready: OrderedDict[int, AdapterWeights] = OrderedDict()
        # Reads under way or queued behind one: (future, its spec).
        self._reading: dict[int, tuple[cf.Future[AdapterWeights], AdapterSpec]] = {}
        # When each read under way began (set by the reader thread): its deadline runs from there.
        self._started: dict[int, float] = {}
        # Adapters whose read was given up: (the error, until when it is refused).
        self._hung: dict[int, tuple[str, float]] = {}
        self._pool = _reader_pool()
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
        self._check_not_hung(spec)
        reading = self._reading.get(lora_id)
        if reading is None:
            self._reading[lora_id] = (self._pool.submit(self._read, spec), spec)
            return False
        future = reading[0]
        if not future.done():
            started = self._started.get(lora_id)
            if started is not None and time.monotonic() - started > self.read_timeout_s:
                self._give_up(spec)
            return False
        del self._reading[lora_id]
        self._started.pop(lora_id, None)
        self._ready[lora_id] = future.result()  # a read that failed raises its ValueError here
        self._evict()
        self.resident_ids = frozenset(self._ready)
        return True

    def wait(self, timeout: float) -> None:
        if self._reading:
            cf.wait([future for future, _ in self._reading.values()], timeout, return_when=cf.FIRST_COMPLETED)

    def get(self, lora_id: int) -> AdapterWeights:
        return self._ready[lora_id]

    def resident(self) -> list[AdapterSpec]:
        """The adapters in host memory, least recently used first."""
        return [w.spec for w in self._ready.values()]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_not_hung(self, spec: AdapterSpec) -> None:
        hung = self._hung.get(spec.lora_int_id)
        if hung is None:
            return
        error, until = hung
        if time.monotonic() < until:
            raise ValueError(error)
        del self._hung[spec.lora_int_id]  # refused long enough: read it anew

    def _give_up(self, spec: AdapterSpec) -> None:
        """A read past its deadline: its requests end (ValueError, as a failed
        read's do); a new reader thread takes the reads queued behind it."""
        error = (f"LoRA adapter {spec.name!r}: reading its files took over {self.read_timeout_s:.0f} s "
                 f"(a hung volume?); its requests end")
        self._hung[spec.lora_int_id] = (error, time.monotonic() + self.read_timeout_s)
        del self._reading[spec.lora_int_id]
        self._started.pop(spec.lora_int_id, None)
        stuck, self._pool = self._pool, _reader_pool()
        stuck.shutdown(wait=False, cancel_futures=True)  # the stuck thread ends when its read does
        for lora_id, (future, queued) in list(self._reading.items()):
            if future.cancelled():
                self._reading[lora_id] = (self._pool.submit(self._read, queued), queued)
        logger.error("%s", error)
        raise ValueError(error)

    def _read(self, spec: AdapterSpec) -> AdapterWeights:
        self._started[spec.lora_int_id] = time.monotonic()
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


def _reader_pool() -> cf.ThreadPoolExecutor:
    # One reader: adapters are read one after another, never competing for the disk.
    return cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
