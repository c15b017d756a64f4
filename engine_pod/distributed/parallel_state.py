"""The groups a worker belongs to, and their collectives.

A rank's layers call these and nothing in torch.distributed directly, so a
single-rank group (TP=1, no process group at all) runs the same model code
with every collective a no-op.

Pipeline parallelism (PP stages of TP ranks each) lays the world out as vLLM
does: global rank = stage * tp_size + tp_rank. A stage's TP collectives run
on its own subgroup (``torch.distributed.new_group``, created by every rank in
the same order); at PP=1 the TP group is the default (world) group, as it
always was. Between stages, rank (s, t) sends its hidden states to rank
(s + 1, t) point to point. The sampled tokens travel no collective: the last
stage's first rank (the one that samples) returns them to the engine, and the
other ranks get them with the next step that needs them (the scheduler's
CachedRequestData.new_token_ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# Peers compute the same step, so a collective waits for milliseconds; a dead
# peer closes its sockets and fails it at once. The timeout only bounds a
# wedged peer (the executor's death-watch reports dead ones sooner).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks of one pipeline stage that split its layers; ``rank`` and
    ``world_size`` are within the group (the TP rank and size)."""

    rank: int
    world_size: int
    device: torch.device
    process_group: object = field(default=None, compare=False, repr=False)
    """The stage's subgroup under PP>1; None: the default (world) group."""
    first_global_rank: int = 0
    """The global rank of this group's rank 0."""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.process_group)
        return x

    def gather_last_dim_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's [..., n] along the last dim on rank 0
        (logits of the vocab shards); the other ranks get None. A gather, not
        an all-gather: only rank 0 samples."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(x, parts, dst=self.first_global_rank, group=self.process_group)
        return torch.cat(parts, dim=-1) if self.is_first else None


def sampler_rank(world_size: int, pp_size: int) -> int:
    """The global rank that samples (and whose replies are the engine's
    results): the last stage's TP rank 0; rank 0 without pipeline stages."""
    return world_size - world_size // pp_size


@dataclass(frozen=True)
class PipelineGroup:
    """This rank's place in the pipeline: its stage, and the transfers
    between stages. One stage (PP=1) sends and receives nothing."""

    stage: int
    num_stages: int
    tp_size: int
    rank: int  # global: stage * tp_size + tp_rank
    device: torch.device

    @property
    def world_size(self) -> int:
        return self.num_stages * self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def sampler_rank(self) -> int:
        return sampler_rank(self.world_size, self.num_stages)

    @property
    def is_sampler(self) -> bool:
        return self.rank == self.sampler_rank

    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        """This stage's output (hidden states, residual) to the same TP rank of the next stage."""
        for x in tensors:
            dist.send(x.contiguous(), dst=self.rank + self.tp_size)

    def recv_from_previous_stage(self, count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """``count`` tensors of ``shape`` from the same TP rank of the previous
        stage (the shapes follow from the step, which every rank has)."""
        out = []
        for _ in range(count):
            x = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(x, src=self.rank - self.tp_size)
            out.append(x)
        return out


def single_rank_group(device: torch.device) -> TensorParallelGroup:
    return TensorParallelGroup(0, 1, device)


def single_stage(group: TensorParallelGroup) -> PipelineGroup:
    """No pipeline: one stage of ``group`` (whose global ranks are its ranks)."""
    return PipelineGroup(0, 1, group.world_size, group.rank, group.device)


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The decoder layers of ``stage``, vLLM's split: equal shares, and the
    remainder one each to the stages before the last, from the second-to-last
    backwards (the last stage also computes the logits). 10 layers over 4
    stages: 2, 3, 3, 2."""
    sizes = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        sizes[-i] += 1
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


def init_tensor_parallel_group(rank: int, world_size: int, store_path: str,
                               device: torch.device) -> TensorParallelGroup:
    """Join the group (PP=1): gloo on CPU, nccl on CUDA (device ``cuda:rank``).

    Rendezvous through a file the executor names, not a TCP port: no port to
    pick, so no race with other engines on the machine.
    """
    group, _ = init_parallel_groups(rank, world_size, 1, store_path, device)
    return group


def init_parallel_groups(rank: int, tp_size: int, pp_size: int, store_path: str,
                         device: torch.device, local_rank: int | None = None,
                         store_address: tuple[str, int] | None = None,
                         store_timeout: timedelta = COLLECTIVE_TIMEOUT) -> tuple[TensorParallelGroup, PipelineGroup]:
    """Join the world of ``tp_size * pp_size`` ranks; with more than one
    stage, also create every stage's TP subgroup (all ranks create all of
    them, in stage order, as new_group requires) and keep this rank's.

    ``store_address``: ranks on several machines meet at the leader's
    TCPStore (host, port) instead of the file ``store_path``; ``local_rank``
    (default ``rank``) picks the CUDA device on this machine."""
    world_size = tp_size * pp_size
    if device.type == "cuda":
        device = torch.device("cuda", rank if local_rank is None else local_rank)
        torch.cuda.set_device(device)
    if world_size > 1:
        if store_address is not None:
            store: dist.Store = dist.TCPStore(store_address[0], store_address[1], world_size, is_master=False,
                                              timeout=store_timeout)
        else:
            store = dist.FileStore(store_path, world_size)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT, **kwargs
        )
    stage, tp_rank = divmod(rank, tp_size)
    if pp_size == 1 or tp_size == 1:
        # PP=1: the TP group is the world; TP=1: a stage of one rank has no collectives.
        group = TensorParallelGroup(tp_rank, tp_size, device, None, stage * tp_size)
    else:
        backend = "nccl" if device.type == "cuda" else "gloo"
        subgroups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=COLLECTIVE_TIMEOUT,
                                    backend=backend) for s in range(pp_size)]
        group = TensorParallelGroup(tp_rank, tp_size, device, subgroups[stage], stage * tp_size)
    return group, PipelineGroup(stage, pp_size, tp_size, rank, device)


def destroy_tensor_parallel_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
