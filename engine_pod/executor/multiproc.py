"""Tensor and pipeline parallelism: one worker process per rank behind one
``execute_model``.

Workers are spawned once (spawn, not fork: a forked copy of a process that
already runs torch threads or CUDA is unsafe): PP x TP of them, rank =
stage * tp_size + tp_rank. Each call is broadcast to every rank through a
shared-memory ring (distributed/shm_broadcast.py); results come back over its
pipe from the rank that samples: rank 0, or under PP the last stage's TP
rank 0. The engine core sees the same interface as at TP=1 and never learns
how many workers there are.

With a KV store, the store stays in this process and holds whole blocks:
loads travel to every rank in the broadcast (each copies in its KV heads);
on steps that offload or save blocks every rank replies with its heads of
them, and the executor assembles and stores the whole blocks
(kv_store_writer.py) before the step returns.

Failure: while waiting, the executor watches every worker's pipe and process
sentinel together, so a worker that raises (its traceback arrives on its
pipe) or dies (its sentinel fires) fails the call at once with that cause
(also while the others block in a collective or, under PP, in a receive from
the dead stage: they are terminated, not waited for);
the remaining workers are stopped before the error is raised, and every later
call raises the same error. Workers watch their parent in turn and exit if it
disappears, so no process outlives the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch

from engine_pod.config import EngineConfig
from engine_pod.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine_pod.distributed.parallel_state import sampler_rank
from engine_pod.distributed.shm_broadcast import BroadcastWriter
from engine_pod.executor.abstract import Executor
from engine_pod.executor.kv_store_writer import put_step_blocks
from engine_pod.worker.worker_process import SHUTDOWN, WorkerCall, WorkerReply, WorkerSpec, run_worker
from kv_store.tiered_store import TieredKVStore

logger = logging.getLogger(__name__)

# Loading a large checkpoint on a busy machine can take minutes.
START_TIMEOUT_SECONDS = 600.0
# Graceful stop, then SIGTERM, then SIGKILL, each waited for this long.
STOP_GRACE_SECONDS = 5.0


def _picklable(scheduler_output: SchedulerOutput) -> SchedulerOutput:
    """The step as the broadcast can pickle it: the store hands loads over as
    views of its values (memoryviews), which cross to the workers as bytes."""
    meta = scheduler_output.kv_connector
    if meta is None or not meta.loads:
        return scheduler_output
    loads = [(block_id, bytes(payload)) for block_id, payload in meta.loads]
    return dataclasses.replace(scheduler_output, kv_connector=dataclasses.replace(meta, loads=loads))


class WorkerError(RuntimeError):
    """A tensor- or pipeline-parallel worker died or raised: the engine cannot continue."""


@dataclass
class _Worker:
    rank: int
    process: mp.process.BaseProcess
    replies: Connection


def _stop_workers(workers: list[_Worker], channel: BroadcastWriter, rendezvous_dir: str, graceful: bool) -> None:
    """Stop every worker and release what they shared. Holds no reference to
    the executor, so it can also run as its finalizer at interpreter exit."""
    if graceful and all(w.process.is_alive() for w in workers):
        try:
            channel.write(WorkerCall(SHUTDOWN), check_alive=lambda: None)
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
    for w in workers:
        w.process.join(STOP_GRACE_SECONDS)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.replies.close()
    channel.close()
    shutil.rmtree(rendezvous_dir, ignore_errors=True)


class MultiProcExecutor(Executor):
    def __init__(self, config: EngineConfig, world_size: int | None = None) -> None:
        """``world_size`` defaults to the configured PP x TP size (the overhead
        benchmark runs one rank through this executor)."""
        self.pp_size = config.parallel.pipeline_parallel_size
        self.world_size = world_size or config.parallel.world_size
        if self.world_size % self.pp_size:
            raise ValueError(f"world_size={self.world_size} is not a multiple of "
                             f"pipeline_parallel_size={self.pp_size}")
        self.tp_size = self.world_size // self.pp_size
        # The rank whose replies are the engine's results: the one that samples.
        self.sampler_rank = sampler_rank(self.world_size, self.pp_size)
        self._failure: str | None = None
        self._starting = True
        self._forward_seconds = 0.0
        # Wall time of execute_model calls minus the time the worker spent in
        # them: what the broadcast and the result pipe cost.
        self.channel_seconds = 0.0
        self.num_steps = 0
        self.last_broadcast_bytes = 0
        self._kv_store: TieredKVStore | None = None
        ctx = mp.get_context("spawn")
        self._channel = BroadcastWriter(ctx, self.world_size)
        self._rendezvous_dir = tempfile.mkdtemp(prefix="tessera-tp-")
        threads = config.parallel.worker_threads or max(1, torch.get_num_threads() // self.world_size)
        self._workers: list[_Worker] = []
        # Registered before the first spawn, so a failure part-way through
        # still stops the workers already started (and runs at interpreter exit).
        self._finalizer = weakref.finalize(
            self, _stop_workers, self._workers, self._channel, self._rendezvous_dir, True
        )
        for rank in range(self.world_size):
            receive, send = ctx.Pipe(duplex=False)
            spec = WorkerSpec(
                rank, self.world_size, config, os.path.join(self._rendezvous_dir, "store"),
                self._channel.reader_spec(), send, os.getpid(), threads, self.pp_size,
            )
            process = ctx.Process(target=run_worker, args=(spec,), name=f"tessera-rank{rank}", daemon=True)
            process.start()
            send.close()  # the worker holds the only write end: EOF when it dies
            self._workers.append(_Worker(rank, process, receive))
        try:
            self._collect(range(self.world_size), timeout=START_TIMEOUT_SECONDS)
        except BaseException:
            self.shutdown()
            raise
        self._channel.unlink()  # every rank has mapped it
        self._starting = False
        logger.info("%d workers ready (PP=%d x TP=%d, pids %s)", self.world_size, self.pp_size, self.tp_size,
                    self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    # -- the Executor interface ------------------------------------------
    def determine_num_blocks(self) -> int:
        # Every rank must hold every block: the pool is the smallest rank's.
        return min(self._call_all("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)

    def attach_kv_store(self, store: TieredKVStore) -> None:
        """The store stays here, in the engine core's process; the ranks get
        its (whole-block) layout and copy their own KV heads in and out."""
        self._kv_store = store
        self._call_all("attach_kv_store", store.codec.layout)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        meta = scheduler_output.kv_connector if self._kv_store is not None else None
        # Every rank replies only on steps that read blocks back for the store
        # (its heads of them); ordinary steps keep the one reply of the sampling rank.
        gather = meta is not None and meta.reads_blocks
        ranks = range(self.world_size) if gather else [self.sampler_rank]
        self._broadcast(WorkerCall("execute_model", (_picklable(scheduler_output),), all_ranks_reply=gather))
        replies = self._collect(ranks, timeout=None)
        reply = replies[self.sampler_rank]
        self.channel_seconds += time.perf_counter() - start - reply.call_seconds
        self.num_steps += 1
        out: ModelRunnerOutput = reply.value
        if gather:
            assert self._kv_store is not None and meta is not None
            put_step_blocks(self._kv_store, meta, [replies[rank].value.kv_connector_output for rank in ranks])
        out.kv_connector_output = None
        return out

    def collective_rpc(self, method: str, *args) -> list:
        return self._call_all(method, *args)

    @property
    def forward_seconds(self) -> float:
        return self._forward_seconds

    def shutdown(self) -> None:
        self._finalizer()  # runs once; later calls are no-ops

    # -- plumbing ----------------------------------------------------------
    def _call_all(self, method: str, *args) -> list:
        self._broadcast(WorkerCall(method, args, all_ranks_reply=True))
        replies = self._collect(range(self.world_size), timeout=None)
        return [replies[rank].value for rank in range(self.world_size)]

    def _broadcast(self, call: WorkerCall) -> None:
        if self._failure is not None:
            raise WorkerError(self._failure)
        self.last_broadcast_bytes = self._channel.write(call, check_alive=self._check_alive)

    def _check_alive(self) -> None:
        for w in self._workers:
            if not w.process.is_alive():
                self._collect_pending_errors()
                self._fail(self._death_message(w))

    def _collect(self, ranks, timeout: float | None) -> dict[int, WorkerReply]:
        """Replies of ``ranks``, failing at once if any worker raises or dies."""
        pending = set(ranks)
        replies: dict[int, WorkerReply] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        by_conn = {w.replies: w for w in self._workers}
        by_sentinel = {w.process.sentinel: w for w in self._workers}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*by_conn, *by_sentinel], timeout=remaining)
            if not ready:
                self._fail(f"{self._kind} workers {sorted(pending)} did not answer within {timeout:.0f}s")
            # Pipes first: a worker that raised sends its traceback, then dies.
            for conn in (r for r in ready if r in by_conn):
                reply = self._receive(by_conn[conn])
                if reply.kind == "error":
                    self._fail_with_error(by_conn[conn], reply.value)
                self._forward_seconds = max(self._forward_seconds, reply.forward_seconds)
                replies[by_conn[conn].rank] = reply
                pending.discard(by_conn[conn].rank)
            for sentinel in (r for r in ready if r in by_sentinel):
                worker = by_sentinel[sentinel]
                if worker.replies.poll():
                    continue  # read its last words on the next round
                self._fail(self._death_message(worker))
        return replies

    def _receive(self, worker: _Worker) -> WorkerReply:
        try:
            return worker.replies.recv()
        except (EOFError, OSError):
            worker.process.join(1.0)
            self._fail(self._death_message(worker))

    def _collect_pending_errors(self) -> None:
        for w in self._workers:
            if w.replies.poll():
                try:
                    reply = w.replies.recv()
                except (EOFError, OSError):
                    continue
                if reply.kind == "error":
                    self._fail_with_error(w, reply.value)

    def _fail_with_error(self, worker: _Worker, error: str):
        """A rank's traceback; but when another rank died silently, that death
        is the cause (the survivors' collectives fail because of it)."""
        message = f"{self._worker_name(worker)} failed:\n{error}"
        for other in self._workers:
            if other is not worker and not other.process.is_alive() and not other.replies.poll():
                message = f"{self._death_message(other)}; rank {worker.rank} then failed:\n{error}"
                break
        self._fail(message)

    def _death_message(self, worker: _Worker) -> str:
        worker.process.join(1.0)  # let the exit code settle
        code = worker.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        message = f"{self._worker_name(worker, pid=True)} {how}"
        if self._starting:
            message += (f" during start-up (its stderr shows why; a script that builds a {self._kind} engine "
                        "needs an `if __name__ == '__main__':` guard, since spawned workers import it)")
        return message

    @property
    def _kind(self) -> str:
        return "pipeline-parallel" if self.pp_size > 1 else "tensor-parallel"

    def _worker_name(self, worker: _Worker, pid: bool = False) -> str:
        """"tensor-parallel worker rank 1 (pid 42)"; under PP with its stage:
        "pipeline-parallel worker rank 2 (pid 42, stage 1)"."""
        details = [f"pid {worker.process.pid}"] if pid else []
        if self.pp_size > 1:
            details.append(f"stage {worker.rank // self.tp_size}")
        return f"{self._kind} worker rank {worker.rank}" + (f" ({', '.join(details)})" if details else "")

    def _fail(self, message: str):
        """Stop every worker, remember why, and raise it (now and on every later call)."""
        if self._failure is None:
            self._failure = message
            logger.error("%s; stopping the other workers", message)
            self._finalizer.detach()
            _stop_workers(self._workers, self._channel, self._rendezvous_dir, graceful=False)
        raise WorkerError(self._failure)
