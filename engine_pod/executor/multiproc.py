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

Across nodes (``--nnodes N``, config.parallel.nodes): this executor runs on
the leader (node 0) and spawns only its local ranks; the world group meets
at a TCPStore it hosts on ``master_port``, and every other node (a
``tessera engine --node-rank K`` process, executor/node_follower.py) dials
``master_port + 1`` once and authenticates (distributed/node_channel.py).
Calls go to each node over that link and the node relays them to its ranks
through its own ring; its ranks' replies come back over it. A node whose
link drops or goes silent, or whose rank dies, fails the group like a local
rank (WorkerError naming the node and the rank), also while the engine is
idle (``on_group_failure``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch

from engine_pod.config import EngineConfig, NodeLayout
from engine_pod.core.scheduler_output import KVConnectorMetadata, ModelRunnerOutput, SchedulerOutput
from engine_pod.executor.group_identity import group_identity
from engine_pod.distributed.join_stop import JOIN_STOP, JoinStopped
from engine_pod.distributed.node_channel import (
    KEY_PURPOSE,
    ChannelError,
    NodeChannel,
    NodeLink,
    listen,
    node_channel_port,
)
from engine_pod.distributed.parallel_state import sampler_rank
from engine_pod.distributed.shm_broadcast import BroadcastWriter
from engine_pod.executor.abstract import Executor
from engine_pod.executor.kv_store_writer import put_step_blocks
from engine_pod.executor.node_acceptor import JoinTimeout, NodeAcceptor
from engine_pod.worker.stage_timing import StageTiming, StageTimingBoard
from engine_pod.worker.worker_process import SHUTDOWN, WorkerCall, WorkerReply, WorkerSpec, run_worker
from kv_store.tiered_store import TieredKVStore
from tessera.internal_secret import InternalSecret

logger = logging.getLogger(__name__)

# Loading a large checkpoint on a busy machine can take minutes.
START_TIMEOUT_SECONDS = 600.0
# Graceful stop, then SIGTERM, then SIGKILL, each waited for this long.
STOP_GRACE_SECONDS = 5.0
# How long a rank's failure waits for a peer whose death may have caused it to be seen dead.
DEATH_SETTLE_SECONDS = 0.2
# How long a rank's failure in a collective waits for another node's word on its cause.
REMOTE_CAUSE_SECONDS = 1.0
# How often start-up checks whether the pod was asked to stop (distributed/join_stop.py).
STOP_POLL_SECONDS = 0.5


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
class _Step:
    """A step broadcast and not yet answered."""

    gather: KVConnectorMetadata | None
    """Its KV store metadata when every rank replies with blocks for the store; None: the sampler alone replies."""
    submitted: float
    """perf_counter() when it was broadcast."""


@dataclass
class _Worker:
    rank: int
    process: mp.process.BaseProcess
    replies: Connection


@dataclass
class _Node:
    """Another node of the group, reached over its authenticated link."""

    index: int
    ranks: range
    link: NodeLink

    def name(self) -> str:
        return _node_name(self.index, self.ranks)


def _node_name(index: int, ranks: range) -> str:
    return f"node {index} (ranks {ranks.start}-{ranks.stop - 1})"


@dataclass
class _Shared:
    """What the workers share besides their processes, released on stop."""

    nodes: list[_Node] = field(default_factory=list)
    store: object = None  # the leader's TCPStore (torch.distributed) across nodes


def _stop_workers(workers: list[_Worker], channel: BroadcastWriter, rendezvous_dir: str, graceful: bool,
                  shared: _Shared | None = None) -> None:
    """Stop every worker (and tell the other nodes) and release what they
    shared. Holds no reference to the executor, so it can also run as its
    finalizer at interpreter exit."""
    nodes = shared.nodes if shared is not None else []
    if graceful and all(w.process.is_alive() for w in workers) and all(n.link.lost is None for n in nodes):
        for node in nodes:
            try:
                node.link.send_last(WorkerCall(SHUTDOWN))
            except ChannelError:
                pass
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
    for node in nodes:
        node.link.close()  # a node still running sees its link close and stops its ranks
    if shared is not None:
        shared.nodes.clear()
        shared.store = None
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
        # Steps submitted and not yet taken, oldest first; and each rank's replies not yet taken.
        self._in_flight: collections.deque[_Step] = collections.deque()
        self._replies: dict[int, collections.deque[WorkerReply]] = {
            rank: collections.deque() for rank in range(self.world_size)}
        layout: NodeLayout = config.parallel.nodes if world_size is None else NodeLayout()
        if not layout.is_leader:
            raise ValueError(f"node_rank={layout.node_rank}: only the leader (node 0) runs the engine core")
        self.layout = layout
        self._config = config
        self.local_ranks = layout.local_ranks(self.world_size)
        self.on_group_failure: Callable[[str], None] | None = None
        """Called (on a link's thread) when another node is lost, also while no call runs."""
        ctx = mp.get_context("spawn")
        self._channel = BroadcastWriter(ctx, len(self.local_ranks))
        self._stage_board = StageTimingBoard(ctx, self.world_size, self.tp_size)
        self._rendezvous_dir = tempfile.mkdtemp(prefix="tessera-tp-")
        threads = config.parallel.worker_threads or max(1, torch.get_num_threads() // len(self.local_ranks))
        self._workers: list[_Worker] = []
        self._shared = _Shared()
        self._nodes = self._shared.nodes
        # Registered before the first spawn, so a failure part-way through
        # still stops the workers already started (and runs at interpreter exit).
        self._finalizer = weakref.finalize(
            self, _stop_workers, self._workers, self._channel, self._rendezvous_dir, True, self._shared
        )
        listener, key, store_address = None, b"", None
        try:
            if layout.nnodes > 1:
                assert layout.master_addr is not None  # NodeLayout requires it above one node
                secret = InternalSecret.require("the nodes of a multi-node engine authenticate each other")
                key = secret.derive(KEY_PURPOSE)
                import torch.distributed as dist

                # The world group's rendezvous, hosted here on the leader: every rank (here and on
                # the other nodes) meets at it, then gloo/NCCL connect the ranks pairwise.
                self._shared.store = dist.TCPStore(
                    layout.master_addr, layout.master_port, self.world_size, is_master=True,
                    timeout=timedelta(seconds=layout.join_timeout_s), wait_for_workers=False)
                store_address = (layout.master_addr, layout.master_port)
                listener = listen(node_channel_port(layout.master_port))
            for index, rank in enumerate(self.local_ranks):
                receive, send = ctx.Pipe(duplex=False)
                spec = WorkerSpec(
                    rank, self.world_size, config, os.path.join(self._rendezvous_dir, "store"),
                    self._channel.reader_spec(), send, os.getpid(), threads, self.pp_size,
                    local_index=index, store_address=store_address, store_timeout_s=layout.join_timeout_s,
                    stage_board=self._stage_board,
                )
                process = ctx.Process(target=run_worker, args=(spec,), name=f"tessera-rank{rank}", daemon=True)
                process.start()
                send.close()  # the worker holds the only write end: EOF when it dies
                self._workers.append(_Worker(rank, process, receive))
            if listener is not None:
                self._accept_nodes(listener, key)
            self._collect(range(self.world_size), timeout=START_TIMEOUT_SECONDS)
        except BaseException:
            self.shutdown()
            raise
        finally:
            if listener is not None:
                listener.close()  # a node that joins later cannot: the group restarts together
        self._channel.unlink()  # every rank has mapped it
        self._starting = False
        logger.info("%d workers ready (PP=%d x TP=%d, pids %s%s)", self.world_size, self.pp_size, self.tp_size,
                    self.worker_pids,
                    f"; ranks {self.local_ranks.start}-{self.local_ranks.stop - 1} here, "
                    f"{len(self._nodes)} other nodes" if self._nodes else "")

    def _accept_nodes(self, listener, key: bytes) -> None:
        """Take one authenticated connection from every other node, within the
        join timeout (executor/node_acceptor.py); each node's link starts (its
        heartbeats with it) as soon as it joins, while the others are awaited."""

        def joined(node_rank: int, channel: NodeChannel, peer: str) -> None:
            node = _Node(node_rank, self.layout.local_ranks_of(node_rank, self.world_size),
                         NodeLink(channel, on_lost=functools.partial(self._node_lost, node_rank)))
            self._nodes.append(node)
            logger.info("engine group: %s joined from %s", node.name(), peer)
            try:
                # The node checks it against its own before starting its ranks (group_identity.py).
                node.link.send(("identity", identity))
            except ChannelError as e:
                self._fail(f"lost {node.name()}: {e}")

        identity = group_identity(self._config)

        try:
            NodeAcceptor(listener, key, self.layout).run(joined, self._check_alive, JOIN_STOP)
        except JoinTimeout as e:
            self._fail(str(e))
        except JoinStopped:
            # The ranks here wait at the rendezvous for nodes that will not come: none would
            # answer a graceful stop, so they are stopped at once.
            self._stop_now()
            raise

    def _stop_now(self) -> None:
        """Stop every rank without asking (they are not reading calls yet)."""
        self._finalizer.detach()
        _stop_workers(self._workers, self._channel, self._rendezvous_dir, graceful=False, shared=self._shared)

    def _node_lost(self, node_rank: int, message: str) -> None:
        name = _node_name(node_rank, self.layout.local_ranks_of(node_rank, self.world_size))
        logger.error("engine group: lost %s: %s", name, message)
        if self.on_group_failure is not None and self._failure is None:
            self.on_group_failure(f"lost {name}: {message}")

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

    @property
    def max_concurrent_batches(self) -> int:
        # One step per pipeline stage: a stage passes a step on without waiting for its tokens.
        return self.pp_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit_model(scheduler_output)
        return self.take_model_output()

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        meta = scheduler_output.kv_connector if self._kv_store is not None else None
        # Every rank replies only on steps that read blocks back for the store
        # (its heads of them); ordinary steps keep the one reply of the sampling rank.
        gather = meta is not None and meta.reads_blocks
        self._broadcast(WorkerCall("execute_model", (_picklable(scheduler_output),), all_ranks_reply=gather))
        self._in_flight.append(_Step(meta if gather else None, time.perf_counter()))

    def take_model_output(self) -> ModelRunnerOutput:
        step = self._in_flight.popleft()
        ranks = range(self.world_size) if step.gather is not None else [self.sampler_rank]
        replies = self._collect(ranks, timeout=None)
        reply = replies[self.sampler_rank]
        if len(self._in_flight) == 0:
            # With steps overlapping, the channel's share is only known for one alone.
            self.channel_seconds += time.perf_counter() - step.submitted - reply.call_seconds
        self.num_steps += 1
        out: ModelRunnerOutput = reply.value
        if step.gather is not None:
            assert self._kv_store is not None
            put_step_blocks(self._kv_store, step.gather, [replies[rank].value.kv_connector_output for rank in ranks])
        out.kv_connector_output = None
        return out

    def stage_timings(self) -> list[StageTiming]:
        """This node's ranks' figures, and the other nodes' as their latest heartbeats carried them."""
        timings = self._stage_board.read(self.local_ranks)
        for node in list(self._nodes):
            timings += node.link.peer_status or []
        return timings

    def collective_rpc(self, method: str, *args) -> list:
        return self._call_all(method, *args)

    @property
    def forward_seconds(self) -> float:
        return self._forward_seconds

    def shutdown(self) -> None:
        self._finalizer()  # runs once; later calls are no-ops

    # -- plumbing ----------------------------------------------------------
    def _call_all(self, method: str, *args) -> list:
        if self._in_flight:
            # Its replies would queue behind the steps': the engine takes every step's output first.
            raise RuntimeError(f"{method}: {len(self._in_flight)} steps are still in flight")
        self._broadcast(WorkerCall(method, args, all_ranks_reply=True))
        replies = self._collect(range(self.world_size), timeout=None)
        return [replies[rank].value for rank in range(self.world_size)]

    def _broadcast(self, call: WorkerCall) -> None:
        if self._failure is not None:
            raise WorkerError(self._failure)
        for node in self._nodes:
            try:
                node.link.send(call)
            except ChannelError as e:
                self._fail(f"lost {node.name()}: {e}")
        self.last_broadcast_bytes = self._channel.write(call, check_alive=self._check_alive)

    def _check_alive(self) -> None:
        for w in self._workers:
            if not w.process.is_alive():
                self._collect_pending_errors()
                self._fail(self._death_message(w))
        for node in self._nodes:
            if node.link.lost is not None:
                self._fail(f"lost {node.name()}: {node.link.lost}")

    def _collect(self, ranks, timeout: float | None) -> dict[int, WorkerReply]:
        """The next reply of each of ``ranks``, failing at once if any worker
        raises or dies (or, across nodes, another node reports one or is lost).
        Replies are read from every rank as they come and queued per rank: with
        several steps in flight a rank may already have answered a later one."""
        pending = {rank for rank in ranks if not self._replies[rank]}
        deadline = None if timeout is None else time.monotonic() + timeout
        by_conn = {w.replies: w for w in self._workers}
        by_sentinel = {w.process.sentinel: w for w in self._workers}
        by_inbox = {n.link.inbox: n for n in self._nodes}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._starting:
                # A pod asked to stop while its ranks load (minutes for a large checkpoint) stops now.
                if JOIN_STOP.is_set():
                    self._stop_now()
                    raise JoinStopped(f"asked to stop while ranks {sorted(pending)} were starting")
                remaining = STOP_POLL_SECONDS if remaining is None else min(remaining, STOP_POLL_SECONDS)
            ready = wait([*by_conn, *by_sentinel, *by_inbox], timeout=remaining)
            if not ready and self._starting and (deadline is None or time.monotonic() < deadline):
                continue
            if not ready:
                self._fail(f"{self._kind} workers {sorted(pending)} did not answer within {timeout:.0f}s")
            # Pipes first: a worker that raised sends its traceback, then dies.
            for conn in (r for r in ready if r in by_conn):
                reply = self._receive(by_conn[conn])
                if reply.kind == "error":
                    self._fail_with_error(by_conn[conn], reply.value)
                self._queue_reply(reply, by_conn[conn].rank, pending)
            for inbox in (r for r in ready if r in by_inbox):
                node = by_inbox[inbox]
                try:
                    message = node.link.receive()
                except ChannelError as e:
                    self._fail(f"lost {node.name()}: {e}")
                kind, rank, value = message
                if kind == "reply" and value.kind != "error":
                    self._queue_reply(value, rank, pending)
                elif kind == "reply":
                    self._fail(f"{self._remote_name(node, rank)} failed:\n{value.value}")
                elif kind == "refused":  # it runs other settings than this leader (group_identity.py)
                    self._fail(f"{node.name()} refused to join: {value}")
                else:  # "dead": the node saw one of its ranks die, and stops
                    self._fail(f"{self._remote_name(node, rank)} {value}")
            for sentinel in (r for r in ready if r in by_sentinel):
                worker = by_sentinel[sentinel]
                if worker.replies.poll():
                    continue  # read its last words on the next round
                self._fail(self._death_message(worker))
        return {rank: self._replies[rank].popleft() for rank in ranks}

    def _queue_reply(self, reply: WorkerReply, rank: int, pending: set[int]) -> None:
        self._forward_seconds = max(self._forward_seconds, reply.forward_seconds)
        self._replies[rank].append(reply)
        pending.discard(rank)

    def _remote_name(self, node: _Node, rank: int) -> str:
        stage = f"stage {rank // self.tp_size}, " if self.pp_size > 1 else ""
        return f"{self._kind} worker rank {rank} ({stage}node {node.index})"

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
        # A killed peer's sockets close a moment before it can be reaped: give its death that moment.
        wait([o.process.sentinel for o in self._workers if o is not worker], timeout=DEATH_SETTLE_SECONDS)
        for other in self._workers:
            if other is not worker and not other.process.is_alive() and not other.replies.poll():
                message = f"{self._death_message(other)}; rank {worker.rank} then failed:\n{error}"
                break
        else:
            cause = self._remote_cause()
            if cause is not None:
                message = f"{cause}; rank {worker.rank} then failed:\n{error}"
        self._fail(message)

    def _remote_cause(self) -> str | None:
        """A rank here failed in a collective: if another node reports (within
        a second: its news travels slower than the broken connection) that one
        of its ranks died or failed, or drops, that is the cause."""
        deadline = time.monotonic() + REMOTE_CAUSE_SECONDS
        for node in self._nodes:
            while node.link.inbox.poll(max(0.0, deadline - time.monotonic())):
                try:
                    kind, rank, value = node.link.receive()
                except ChannelError as e:
                    return f"lost {node.name()}: {e}"
                if kind == "dead":
                    return f"{self._remote_name(node, rank)} {value}"
                if kind == "reply" and value.kind == "error":
                    return f"{self._remote_name(node, rank)} failed:\n{value.value}"
        return None

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
            _stop_workers(self._workers, self._channel, self._rendezvous_dir, graceful=False, shared=self._shared)
        raise WorkerError(self._failure)
