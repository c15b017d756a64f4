"""The engine core's busy loop, apart from the gRPC event loop, feeding
per-request streams.

Why threads of one process: the forward runs in torch kernels that release
the GIL, so the gRPC event loop keeps serving while a step runs, and outputs
cross over with one call_soon_threadsafe per step instead of a serialise
and IPC hop per step. The engine loop runs on the process's main thread and
the event loop on a second one: torch's CPU kernels ran 25-45% slower when
driven from a non-main thread here (OpenMP/MKL thread teams), which cost the
service 15-30% of the offline throughput (docs/benchmarks.md).

The engine thread never waits on clients: each request's outputs go to an
unbounded asyncio queue read by its gRPC handler, so a slow reader only
grows its own queue. New requests and aborts are taken between steps; the
thread sleeps on an event when there is no work.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine_pod.core.scheduler_output import EngineCoreOutput
from engine_pod.core.stats import SchedulerStats
from engine_pod.engine.engine_core import EngineCore
from engine_pod.request import Request
from engine_pod.server.in_flight import InFlightSeconds
from kv_store.block_hash import BlockHash

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """One request's progress in one step, stamped when the step ended."""

    output: EngineCoreOutput
    step_end_time: float


@dataclass(frozen=True)
class StreamEnd:
    """Ends a stream without an engine output: aborted or engine failure."""

    reason: str  # "abort" or "error"
    error: BaseException | None = None


@dataclass(frozen=True)
class LoadSnapshot:
    """Published by the engine thread after every step and whenever it goes
    idle; the event loop reads it without touching the scheduler."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_pending_prefill_tokens: int = 0
    num_waiting_foreground: int = 0
    """Waiting requests other than background ones (Scheduler.num_waiting_foreground)."""
    kv_cache_usage_foreground: float = 0.0
    """The KV usage an interactive request sees (Scheduler.kv_cache_usage_foreground)."""


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        loop: asyncio.AbstractEventLoop,
        on_step: Callable[[SchedulerStats], None] | None = None,
    ) -> None:
        self.core = core
        self._loop = loop
        self.on_step = on_step
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._stop = False
        # Event-loop side only.
        self._streams: dict[str, asyncio.Queue] = {}
        # The integral of len(_streams) over time (the autoscaler's mean concurrency).
        self.in_flight = InFlightSeconds()
        self.snapshot = LoadSnapshot(num_free_blocks=core.num_blocks)
        self.error: BaseException | None = None
        # When the running step began (monotonic), None between steps: the
        # event loop reads it to tell a wedged engine loop from a busy one.
        self._step_started: float | None = None

    # -- event-loop side --------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def step_running_for(self) -> float:
        """Seconds the current step has run (0 between steps). A step that
        never ends (a stopped tensor-parallel worker, a hung kernel) leaves
        every stream of the pod waiting while its gRPC side still answers."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def num_queued(self) -> int:
        """Requests waiting for the engine: its waiting queue plus those not yet taken in."""
        with self._lock:
            pending = len(self._pending_adds)
        return self.snapshot.num_waiting + pending

    def num_queued_foreground(self) -> int:
        """num_queued as the gateway weighs a pod: background requests left out.
        The requests not yet taken in count: a report sent between a request's
        arrival and the next step would otherwise show the pod with room."""
        background = self.core.scheduler.background
        with self._lock:
            pending = len(self._pending_adds) - background.count(self._pending_adds)
        return self.snapshot.num_waiting_foreground + pending

    def num_pending_prefill_tokens(self) -> int:
        """The engine's prefill backlog (Scheduler.num_pending_prefill_tokens)
        as of its last step, plus the prompts not yet taken in."""
        with self._lock:
            pending = sum(len(r.prompt_token_ids) for r in self._pending_adds)
        return self.snapshot.num_pending_prefill_tokens + pending

    def num_cached_prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """The engine's prefix-cache match of ``block_hashes``, in blocks (read
        while the engine thread runs: as of this instant)."""
        return self.core.num_cached_prefix_blocks(block_hashes)

    def add_request(self, request: Request) -> asyncio.Queue:
        if self.error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.error!r}")
        if request.request_id in self._streams:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = queue
        self.in_flight.set(len(self._streams))
        with self._lock:
            self._pending_adds.append(request)
        self._wakeup.set()
        return queue

    def abort(self, request_id: str) -> bool:
        """Abort an in-flight request; its stream ends with reason 'abort'."""
        queue = self._streams.pop(request_id, None)
        if queue is None:
            return False
        queue.put_nowait(StreamEnd("abort"))
        self.in_flight.set(len(self._streams))
        with self._lock:
            self._pending_aborts.append(request_id)
        self._wakeup.set()
        return True

    def stop(self) -> None:
        """Ask run() to return (thread-safe)."""
        self._stop = True
        self._wakeup.set()

    def _dispatch(self, outputs: list[EngineCoreOutput], step_end: float) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is None:
                continue  # aborted while the step ran
            queue.put_nowait(StepOutput(out, step_end))
            if out.finished:
                del self._streams[out.request_id]
        self.in_flight.set(len(self._streams))

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._streams.values():
            queue.put_nowait(StreamEnd("error", error))
        self._streams.clear()
        self.in_flight.set(0)

    # -- engine loop (the caller's thread) --------------------------------
    def _take_pending(self) -> tuple[list[Request], list[str]]:
        with self._lock:
            adds, aborts = self._pending_adds, self._pending_aborts
            self._pending_adds, self._pending_aborts = [], []
        return adds, aborts

    def run(self) -> None:
        """The busy loop; returns after stop() or re-raises an engine failure
        (after failing every open stream)."""
        try:
            while not self._stop:
                self._wakeup.clear()
                adds, aborts = self._take_pending()
                for request in adds:
                    self.core.add_request(request)
                if aborts:
                    self.core.abort_requests(aborts)
                if adds or aborts:
                    # Load reports read the snapshot while the next step runs, which may take
                    # seconds for a long prefill: they must see what it was taken in for.
                    self._publish()
                if not self.core.has_unfinished_requests():
                    self._publish()
                    self._wakeup.wait()
                    continue
                self._step_started = time.monotonic()
                outputs = self.core.step()
                self._step_started = None
                step_end = time.time()
                if self.on_step is not None:
                    self.on_step(self.core.last_stats)
                self._publish()
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs, step_end)
        except BaseException as e:  # noqa: BLE001 - any failure must reach every caller
            logger.exception("engine loop failed")
            self.error = e
            self._loop.call_soon_threadsafe(self._fail_all, e)
            raise

    def _publish(self) -> None:
        scheduler = self.core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        self.snapshot = LoadSnapshot(
            len(scheduler.running), scheduler.num_waiting, pool.get_num_free_blocks(), pool.get_usage(),
            scheduler.num_pending_prefill_tokens(), scheduler.num_waiting_foreground(),
            scheduler.kv_cache_usage_foreground(),
        )
