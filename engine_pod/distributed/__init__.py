"""Process groups and the broadcast channel of tensor-parallel workers."""

from engine_pod.distributed.parallel_state import TensorParallelGroup, init_tensor_parallel_group, single_rank_group

__all__ = ["TensorParallelGroup", "init_tensor_parallel_group", "single_rank_group"]
