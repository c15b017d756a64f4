"""The tensor-parallel group a worker belongs to, and its collectives.

A rank's layers call these and nothing in torch.distributed directly, so a
single-rank group (TP=1, no process group at all) runs the same model code
with every collective a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Peers compute the same step, so a collective waits for milliseconds; a dead
# peer closes its sockets and fails it at once. The timeout only bounds a
# wedged peer (the executor's death-watch reports dead ones sooner).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's [..., n] along the last dim on rank 0
        (logits of the vocab shards); the other ranks get None. A gather, not
        an all-gather: only rank 0 samples."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor on every rank (the sampled token ids)."""
        if self.world_size > 1:
            dist.broadcast(x, src=0)
        return x


def single_rank_group(device: torch.device) -> TensorParallelGroup:
    return TensorParallelGroup(0, 1, device)


def init_tensor_parallel_group(rank: int, world_size: int, store_path: str,
                               device: torch.device) -> TensorParallelGroup:
    """Join the group: gloo on CPU, nccl on CUDA (device ``cuda:rank``).

    Rendezvous through a file the executor names, not a TCP port: no port to
    pick, so no race with other engines on the machine.
    """
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    if world_size > 1:
        store = dist.FileStore(store_path, world_size)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT, **kwargs
        )
    return TensorParallelGroup(rank, world_size, device)


def destroy_tensor_parallel_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
