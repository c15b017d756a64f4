"""A pipeline-parallel engine as local processes (pure): what the operator
runs as a LeaderWorkerSet group of P pods, one per pipeline stage, `tessera
up` runs as P processes on this machine.

The commands are the operator's: the leader (node 0) gets the engine pod's
command plus its group flags (engine_pool.group_args: `--nnodes P --node-rank
0 --master-addr --master-port`) and serves gRPC, health and metrics; each
other node gets the command the operator renders for the group's worker
pods (its stage's ranks only), with its own node rank. What a machine
changes: the leader's address is loopback, each group gets a rendezvous port
of its own (two groups, or another program, would meet on the pods' shared
29500) whose next port (the node channel's) is free too, and what only a pod
has (its probes' port, files mounted from Secrets) is left out, as it is for
every local engine. The caller makes the rest local (the checkpoint's folder,
ports, CPU threads: plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera_operator import engine_pool
from tessera_operator.names import Owner

LOOPBACK = "127.0.0.1"
# What only a pod has, each flag with one value: its probes' port, and files mounted from
# Kubernetes Secrets (a local run warns about those and goes without them).
POD_ONLY_FLAGS = frozenset({"--health-port", "--tls-cert-file", "--tls-key-file", "--tls-client-ca-file",
                            "--tls-server-name", "--kv-redis-ca-file", "--kv-redis-cert-file", "--kv-redis-key-file"})


@dataclass(frozen=True)
class NodeChild:
    """Another process of a pipeline-parallel engine (a LeaderWorkerSet's worker pod): node K > 0 of
    its group, running only its stage's ranks; it serves nothing and dials its leader."""

    name: str
    """e.g. "mixed-0-node-1": its leader's name and its node rank (its log file's name too)."""
    node_rank: int
    """Its --node-rank: the pipeline stage it hosts (one stage per node)."""
    args: list[str]
    """`tessera ...` arguments: the operator's worker command, made local, with its node rank."""
    cpus: frozenset[int] | None
    """The CPUs it is pinned to (None: not pinned)."""


@dataclass(frozen=True)
class LocalGroup:
    """One engine replica's processes."""

    leader_args: list[str]
    """The leader's `tessera ...` arguments: the engine pod's, with the group's flags."""
    nodes: tuple[NodeChild, ...]
    """The other nodes, by node rank."""
    master_port: int
    """The group's rendezvous port on loopback (the node channel takes the next one)."""


def worker_command(owner: Owner, spec: dict, role: str) -> list[str]:
    """The command the operator gives pool `role`'s worker pods (node rank `$(LWS_WORKER_INDEX)`,
    group flags included), less what only a pod has."""
    lws = engine_pool.leader_worker_set(owner, spec, role, 1)
    (container,) = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    args, out = list(container["args"]), []
    while args:
        arg = args.pop(0)
        if arg in POD_ONLY_FLAGS:
            args.pop(0)  # its value
        else:
            out.append(arg)
    return out


def local_group(spec: dict, role: str, name: str, leader_args: list[str], node_args: list[list[str]],
                master_port: int, cpu_sets: list[frozenset[int] | None]) -> LocalGroup:
    """Replica `name` of pool `role` as a group: the leader from the engine's local command line
    `leader_args`, node K from `node_args[K - 1]` (the worker command made local), each node
    pinned to `cpu_sets[K]` (the leader's is `cpu_sets[0]`), meeting at `master_port` on loopback."""
    size = engine_pool.pool_pipeline_parallel_size(spec, role)
    if not (len(node_args) + 1 == len(cpu_sets) == size > 1):
        raise ValueError(f"{name}: a pipeline-parallel group of {size} stages needs {size - 1} node commands and "
                         f"{size} CPU shares, got {len(node_args)} and {len(cpu_sets)}")
    if not 0 < master_port < 65535:
        raise ValueError(f"{name}: master port {master_port} leaves no port for the node channel (1-65534)")
    leader = _with_values(list(leader_args) + engine_pool.group_args(spec, role, "0"), name, 0, master_port)
    nodes = tuple(NodeChild(f"{name}-node-{rank}", rank, _with_values(args, name, rank, master_port), cpu_sets[rank])
                  for rank, args in enumerate(node_args, start=1))
    return LocalGroup(leader, nodes, master_port)


def _with_values(args: list[str], name: str, node_rank: int, master_port: int) -> list[str]:
    """`args` with node `node_rank`'s group flags set: itself, and its leader on loopback at `master_port`."""
    values = {"--node-rank": str(node_rank), "--master-addr": LOOPBACK, "--master-port": str(master_port)}
    out = list(args)
    for flag, value in values.items():
        if flag not in out[:-1]:
            raise ValueError(f"{name}: node {node_rank}'s command has no {flag} (not a group's command)")
        out[out.index(flag) + 1] = value
    return out
