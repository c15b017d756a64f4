"""A node other than the leader of a multi-node engine (``tessera engine
--node-rank K``, K > 0): no engine core, no scheduler, no gRPC server; only
this node's ranks.

It dials the leader (distributed/node_channel.py: mutual HMAC
authentication, then MAC'd frames), checks that the leader runs its settings
(executor/group_identity.py; on a difference it tells the leader which and
exits 1 before starting a rank), spawns its local ranks (which join the
world group at the leader's TCPStore), and then relays: each call from the
leader goes to its ranks through a shared-memory ring, as on the leader; each
reply of a local rank goes back to the leader (the ranks themselves decide
whether to reply, exactly as on one machine).

It exits non-zero, after stopping its ranks, when the leader goes away (its
link closes or stays silent past the peer timeout), when a local rank dies
(the leader is told which first), or when the leader does not answer within
the join timeout; 0 when the leader shuts the group down or on SIGTERM
(also while it still waits for the leader: distributed/join_stop.py).
Its ranks also watch this process and exit if it disappears: no orphans.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import tempfile
import threading
import time
from multiprocessing.connection import wait

import torch

from engine_pod.config import EngineConfig
from engine_pod.distributed.join_stop import JoinStopped
from engine_pod.distributed.node_channel import (
    KEY_PURPOSE,
    ChannelError,
    NodeChannel,
    NodeLink,
    connect_to_leader,
    node_channel_port,
)
from engine_pod.distributed.shm_broadcast import BroadcastWriter
from engine_pod.executor.multiproc import _stop_workers, _Worker
from engine_pod.executor.group_identity import group_identity, identity_differences
from engine_pod.worker.stage_timing import StageTimingBoard
from engine_pod.worker.worker_process import SHUTDOWN, WorkerCall, WorkerSpec, run_worker
from tessera.internal_secret import InternalSecret

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
# The leader sends its identity as soon as a node joins: a leader that does not within this is not one.
IDENTITY_TIMEOUT_SECONDS = 10.0


def run_node(config: EngineConfig, stop: threading.Event) -> int:
    """Serve this node's ranks until the group ends; the process exit status."""
    layout = config.parallel.nodes
    assert not layout.is_leader and layout.master_addr is not None
    key = InternalSecret.require("the nodes of a multi-node engine authenticate each other").derive(KEY_PURPOSE)
    world_size = config.parallel.world_size
    ranks = layout.local_ranks(world_size)
    leader = (layout.master_addr, node_channel_port(layout.master_port))
    try:
        channel = connect_to_leader(leader, layout.node_rank, key, time.monotonic() + layout.join_timeout_s, stop)
    except JoinStopped as e:
        logger.warning("node %d: %s; exiting (no rank was started)", layout.node_rank, e)
        return 0
    except ChannelError as e:
        logger.error("node %d: %s", layout.node_rank, e)
        return 1
    refusal = check_identity(channel, config)
    if refusal is not None:
        logger.error("node %d: %s; not joining", layout.node_rank, refusal)
        return 1
    ctx = mp.get_context("spawn")
    # Its ranks' stage figures, which its heartbeats carry to the leader's metrics.
    board = StageTimingBoard(ctx, world_size, world_size // config.parallel.pipeline_parallel_size)
    link = NodeLink(channel, status=lambda: board.read(ranks))
    logger.info("node %d: joined the leader at %s:%d; starting ranks %d-%d", layout.node_rank, *leader,
                ranks.start, ranks.stop - 1)
    ring = BroadcastWriter(ctx, len(ranks))
    rendezvous_dir = tempfile.mkdtemp(prefix="tessera-node-")
    threads = config.parallel.worker_threads or max(1, torch.get_num_threads() // len(ranks))
    workers: list[_Worker] = []
    graceful = False
    try:
        for index, rank in enumerate(ranks):
            receive, send = ctx.Pipe(duplex=False)
            spec = WorkerSpec(rank, world_size, config, os.path.join(rendezvous_dir, "store"), ring.reader_spec(),
                              send, os.getpid(), threads, config.parallel.pipeline_parallel_size,
                              local_index=index, store_address=(layout.master_addr, layout.master_port),
                              store_timeout_s=layout.join_timeout_s, stage_board=board)
            process = ctx.Process(target=run_worker, args=(spec,), name=f"tessera-rank{rank}", daemon=True)
            process.start()
            send.close()
            workers.append(_Worker(rank, process, receive))
        logger.info("node %d: ranks %d-%d started (pids %s)", layout.node_rank, ranks.start, ranks.stop - 1,
                    [w.process.pid for w in workers])
        graceful, status = _relay(layout.node_rank, link, ring, workers, stop)
        return status
    finally:
        link.close()
        _stop_workers(workers, ring, rendezvous_dir, graceful=graceful)
        logger.info("node %d: stopped its ranks", layout.node_rank)


def _relay(node_rank: int, link: NodeLink, ring: BroadcastWriter, workers: list[_Worker],
           stop: threading.Event) -> tuple[bool, int]:
    """(whether the ranks may stop gracefully, the exit status)."""
    by_conn = {w.replies: w for w in workers}
    by_sentinel = {w.process.sentinel: w for w in workers}

    def check_alive() -> None:
        for w in workers:
            if not w.process.is_alive():
                raise _RankDied(w)
        if link.lost is not None:
            raise ChannelError(link.lost)

    try:
        while not stop.is_set():
            ready = wait([link.inbox, *by_conn, *by_sentinel], timeout=POLL_SECONDS)
            for conn in (r for r in ready if r in by_conn):
                worker = by_conn[conn]
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    raise _RankDied(worker) from None
                link.send(("reply", worker.rank, reply))
            for sentinel in (r for r in ready if r in by_sentinel):
                worker = by_sentinel[sentinel]
                if not worker.replies.poll():  # else: read its last words first
                    raise _RankDied(worker)
            if link.inbox in ready:
                call = link.receive()
                if not isinstance(call, WorkerCall):
                    raise ChannelError(f"the leader sent a {type(call).__name__}, not a call")
                ring.write(call, check_alive=check_alive)
                if call.method == SHUTDOWN:
                    logger.info("node %d: the leader shut the group down", node_rank)
                    return True, 0
        logger.info("node %d: asked to stop", node_rank)
        return False, 0
    except _RankDied as e:
        message = _death_message(e.worker)
        logger.error("node %d: rank %d %s; failing the group", node_rank, e.worker.rank, message)
        try:
            link.send(("dead", e.worker.rank, message))
        except ChannelError:
            pass
        return False, 1
    except ChannelError as e:
        logger.error("node %d: lost the leader (%s); stopping this node's ranks", node_rank, e)
        return False, 1


def check_identity(channel: NodeChannel, config: EngineConfig,
                   timeout_s: float = IDENTITY_TIMEOUT_SECONDS) -> str | None:
    """Compare the leader's identity (its first message, due within
    ``timeout_s``) with this node's; on a difference, tell the leader which
    settings differ and return that (None: the same settings)."""
    deadline = time.monotonic() + timeout_s
    try:
        message = None
        while message is None:  # heartbeats may come first, but not for long
            if time.monotonic() >= deadline:
                raise ChannelError(f"nothing but heartbeats for {timeout_s:g}s")
            message = channel.recv_payload()
        kind, identity = pickle.loads(message)
    except (ChannelError, ValueError, TypeError) as e:
        return f"the leader sent no identity ({e})"
    if kind != "identity" or not isinstance(identity, dict):
        return f"the leader sent a {kind!r} message first, not its identity"
    differences = identity_differences(identity, group_identity(config))
    if not differences:
        return None
    refusal = "it runs other settings than the leader (leader's != node's): " + "; ".join(differences)
    try:
        channel.send(("refused", -1, refusal))
    except ChannelError:
        pass
    channel.close()
    return refusal


class _RankDied(Exception):
    def __init__(self, worker: _Worker) -> None:
        super().__init__(worker.rank)
        self.worker = worker


def _death_message(worker: _Worker) -> str:
    worker.process.join(1.0)
    code = worker.process.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return f"(pid {worker.process.pid}) {how}"
