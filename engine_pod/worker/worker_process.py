"""The main of one worker process (one per rank: PP stages x TP ranks).

It joins the process group (and its stage's TP subgroup under PP), builds its
shard of the model (its stage's layers, its TP share of them), reports ready,
then runs whatever the executor broadcasts until told to stop. Only the rank
that samples (rank 0; under PP the last stage's TP rank 0) answers ordinary
calls (its results are the engine's); every rank answers
calls that need all of them (the KV block count, start-up, steps whose KV
blocks go to the store: each rank's heads of them), and any rank
reports its own failure, so the executor can fail fast with the worker's own
traceback.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch

from engine_pod.config import EngineConfig
from engine_pod.distributed.parallel_state import destroy_tensor_parallel_group, init_parallel_groups, sampler_rank
from engine_pod.distributed.shm_broadcast import BroadcastReader, ChannelSpec
from engine_pod.worker.stage_timing import StageTimingBoard


@dataclass
class WorkerSpec:
    rank: int
    world_size: int
    config: EngineConfig
    rendezvous_path: str  # torch.distributed FileStore
    channel: ChannelSpec
    replies: Connection  # this rank's pipe back to the executor
    parent_pid: int
    torch_threads: int | None
    pp_size: int = 1  # pipeline stages; the TP size is world_size // pp_size
    local_index: int | None = None  # this rank's place on its node (ring reader, CUDA device); None: rank
    store_address: tuple[str, int] | None = None  # ranks on several nodes: the leader's TCPStore
    store_timeout_s: float = 600.0  # how long the rendezvous waits for every rank
    stage_board: StageTimingBoard | None = None  # where it publishes its stage figures after each step

    @property
    def local_rank(self) -> int:
        return self.rank if self.local_index is None else self.local_index

    @property
    def sampler_rank(self) -> int:
        """The rank whose replies carry the step's results: the last stage's first."""
        return sampler_rank(self.world_size, self.pp_size)


@dataclass
class WorkerCall:
    """One broadcast message: a ModelRunner method to run on every rank."""

    method: str
    args: tuple = ()
    all_ranks_reply: bool = False


SHUTDOWN = "shutdown"


@dataclass
class WorkerReply:
    kind: str  # "ready", "ok" or "error"
    value: object = None
    call_seconds: float = 0.0  # time the call took in the worker (overhead attribution)
    forward_seconds: float = 0.0  # the runner's running total


def run_worker(spec: WorkerSpec) -> None:
    # Ctrl-C reaches the whole process group; the executor decides when its
    # workers stop (and stops them in order), so ignore it here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def check_parent() -> None:
        # Reparented: the engine process is gone, nobody will stop us.
        if os.getppid() != spec.parent_pid:
            os._exit(1)

    def watch_parent() -> None:
        # Start-up can block for minutes (a checkpoint load, or across nodes the
        # rendezvous waiting for the other nodes' ranks) where no loop checks the parent.
        while True:
            check_parent()
            time.sleep(0.5)

    threading.Thread(target=watch_parent, name="watch-parent", daemon=True).start()
    try:
        from engine_pod.worker.model_runner import ModelRunner

        if spec.torch_threads and spec.config.device.type == "cpu":
            torch.set_num_threads(spec.torch_threads)
        group, pp = init_parallel_groups(spec.rank, spec.world_size // spec.pp_size, spec.pp_size,
                                         spec.rendezvous_path, spec.config.device, spec.local_rank,
                                         spec.store_address, timedelta(seconds=spec.store_timeout_s))
        runner = ModelRunner(spec.config, group, pp)
        reader = BroadcastReader(spec.channel, spec.local_rank)
    except BaseException:  # noqa: BLE001 - reported to the executor, which raises it
        spec.replies.send(WorkerReply("error", traceback.format_exc()))
        raise SystemExit(1) from None
    spec.replies.send(WorkerReply("ready"))
    while True:
        call: WorkerCall = reader.read(check_parent)
        if call.method == SHUTDOWN:
            break
        start = time.perf_counter()
        try:
            value = getattr(runner, call.method)(*call.args)
        except BaseException:  # noqa: BLE001
            spec.replies.send(WorkerReply("error", traceback.format_exc()))
            raise SystemExit(1) from None
        if spec.stage_board is not None and call.method == "execute_model":
            spec.stage_board.publish(spec.rank, runner.stage_timing())
        if call.all_ranks_reply or spec.rank == spec.sampler_rank:
            spec.replies.send(WorkerReply("ok", value, time.perf_counter() - start, runner.forward_seconds))
    reader.close()
    destroy_tensor_parallel_group()
