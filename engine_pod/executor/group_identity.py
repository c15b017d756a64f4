"""What every node of a multi-node engine must agree on before its ranks
start: the same checkpoint, the same layout and the same engine settings that
shape each rank's model and state. A node started from another revision of
the resource (a rollout half done, a hand-edited pod) would otherwise load a
model of another shape, or split it otherwise, and fail later in a
collective with an error that names neither cause, or compute wrong tokens.

The leader sends its identity as the first message over each node's link;
the node compares it with its own and, on any difference, tells the leader
which settings differ (the leader fails the group naming them) and exits 1.
"""

from __future__ import annotations

import hashlib
from importlib import metadata

from engine_pod.config import EngineConfig


def group_identity(config: EngineConfig) -> dict[str, str]:
    """The settings every node's ranks must share, as strings by name."""
    model = config.model
    parallel = config.parallel
    lora = config.lora
    return {
        "tessera version": _version(),
        "model config.json sha256": hashlib.sha256((model.path / "config.json").read_bytes()).hexdigest(),
        "dtype": str(model.dtype),
        "max_model_len": str(model.max_model_len),
        "block_size": str(config.cache.block_size),
        "tensor_parallel_size": str(parallel.tensor_parallel_size),
        "pipeline_parallel_size": str(parallel.pipeline_parallel_size),
        "nnodes": str(parallel.nodes.nnodes),
        "attention_backend": config.attention_backend,
        "seed": str(config.seed),
        "speculative_config": repr(config.speculative),
        "lora": "off" if lora is None else f"max_loras={lora.max_loras} max_lora_rank={lora.max_lora_rank}",
    }


def identity_differences(leader: dict[str, str], node: dict[str, str]) -> list[str]:
    """Each setting the two differ on, as "name: leader's != node's"."""
    names = sorted(set(leader) | set(node))
    return [f"{name}: {leader.get(name, '(absent)')} != {node.get(name, '(absent)')}"
            for name in names if leader.get(name) != node.get(name)]


def _version() -> str:
    try:
        return metadata.version("tessera")
    except metadata.PackageNotFoundError:
        return "unknown"
