"""`tessera up` and pipeline parallelism (pure): a pool with pipelineParallelSize P runs each
replica as a group of P local processes with the operator's LeaderWorkerSet flags (the leader
serving gRPC, P - 1 nodes), on ports of their own, each with its CPU share; the supervisor
watches, stops and restarts the group as one child."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import yaml

from tessera_operator import engine_pool
from tessera_operator.names import Owner
from tessera_operator.validation import validate_inference_service
from tessera_tools.up.child_group import STOP_GRACE_S, ChildGroup, Member
from tessera_tools.up.group_plan import local_group
from tessera_tools.up.plan import LocalOptions, build_plan
from tessera_tools.up.supervisor import ChildFailed, Supervisor

ROOT = Path(__file__).resolve().parents[3]
# What `tessera up` changes in the operator's command, and why: this machine's checkpoint folder,
# loopback ports of its own, the leader on loopback at a rendezvous port of the group's own.
LOCAL_FLAGS = {"--model", "--host", "--grpc-port", "--metrics-port", "--master-addr", "--master-port"}
# Flags only a pod has (its probes' port), and only a local run (its CPU share).
POD_ONLY, LOCAL_ONLY = {"--health-port"}, {"--cpu-threads"}


def _pipeline(stages: int = 2, replicas: int = 1) -> dict:
    resource = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    resource["spec"]["engine"]["pipelineParallelSize"] = stages
    resource["spec"]["pools"]["mixed"]["replicas"] = replicas
    return resource


def _ports():
    """(free_port, free_port_pair) drawing from one counter, as the real ones draw from one machine."""
    counter = iter(range(40000, 40100))
    return (lambda: next(counter)), (lambda: [next(counter), next(counter)][0])


def _flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--")}


def _plan(resource: dict, tiny_llama, **options):
    return build_plan(resource, LocalOptions(models_dir=tiny_llama.parent, **options), *_ports())


def _engine_parser() -> argparse.ArgumentParser:
    from engine_pod.server.main import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser


def _operator_args(resource: dict, node_rank: int) -> list[str]:
    """The engine container's args in the operator's LeaderWorkerSet (leader or worker template), with
    the worker index the LWS controller gives node `node_rank`'s pod expanded, as Kubernetes does."""
    obj = validate_inference_service(resource)
    lws = engine_pool.leader_worker_set(Owner.of(obj), obj["spec"], "mixed", 1)
    template = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate" if node_rank == 0 else "workerTemplate"]
    (container,) = template["spec"]["containers"]
    assert ("$(LWS_WORKER_INDEX)" in container["args"]) == (node_rank > 0)
    return [a.replace("$(LWS_WORKER_INDEX)", str(node_rank)) for a in container["args"]]


def test_a_pipeline_parallel_replica_runs_as_a_leader_and_nodes_with_the_operators_flags(tiny_llama):
    resource = _pipeline(stages=3)
    plan = _plan(resource, tiny_llama, cpus=(0, 1, 2))
    (leader,) = plan.engines
    assert [(n.name, n.node_rank) for n in leader.nodes] == [("mixed-0-node-1", 1), ("mixed-0-node-2", 2)]
    members = [leader.args] + [n.args for n in leader.nodes]
    for rank, args in enumerate(members):
        local, rendered = _flags(args), _flags(_operator_args(resource, rank))
        # The operator's flags, each one here, with its value unless a machine changes it.
        assert set(rendered) - POD_ONLY == set(local) - LOCAL_ONLY
        assert {f: v for f, v in rendered.items() if f not in LOCAL_FLAGS | POD_ONLY} == \
               {f: v for f, v in local.items() if f not in LOCAL_FLAGS | LOCAL_ONLY}
        assert (local["--nnodes"], local["--node-rank"], local["--pipeline-parallel-size"]) == ("3", str(rank), "3")
        assert (local["--master-addr"], local["--master-port"]) == ("127.0.0.1", str(leader.master_port))
    # Only the leader is a pod the gateway routes to: the nodes serve nothing.
    assert plan.gateway_config["pods"]["static"] == [{"address": leader.address, "role": "mixed"}]
    assert _flags(leader.args)["--grpc-port"] == str(leader.grpc_port)


def test_the_engines_own_parser_accepts_every_members_command(tiny_llama):
    from engine_pod.entrypoints.cli_args import node_layout
    from engine_pod.server.main import _validate

    plan = _plan(_pipeline(stages=2, replicas=2), tiny_llama)
    parser = _engine_parser()
    for engine in plan.engines:
        for rank, args in enumerate([engine.args] + [n.args for n in engine.nodes]):
            parsed = parser.parse_args(args)
            _validate(parsed)  # the engine's own checks (the test run holds an internal secret)
            layout = node_layout(parsed)
            assert (layout.nnodes, layout.node_rank, layout.master_addr, layout.master_port) == (
                2, rank, "127.0.0.1", engine.master_port)
            assert parsed.pipeline_parallel_size == 2


def test_every_port_of_every_group_is_its_own(tiny_llama):
    """Two groups: each its own rendezvous port and, next to it, its node channel's, clear of every
    gRPC and metrics port and of the gateway's."""
    from engine_pod.distributed.node_channel import node_channel_port

    plan = _plan(_pipeline(stages=2, replicas=2), tiny_llama)
    ports = [plan.metrics_port]
    for engine in plan.engines:
        ports += [engine.grpc_port, engine.metrics_port, engine.master_port, node_channel_port(engine.master_port)]
    assert len(ports) == len(set(ports)) == 1 + 4 * 2
    assert all(p for p in ports)


def test_the_cpu_split_covers_every_process_of_every_group(tiny_llama):
    plan = _plan(_pipeline(stages=2, replicas=2), tiny_llama, cpus=tuple(range(8)))
    shares = [(e.cpus, e.args) for e in plan.engines] + [(n.cpus, n.args) for e in plan.engines for n in e.nodes]
    assert len(shares) == 4
    assert sorted(cpu for cpus, _ in shares for cpu in cpus) == list(range(8))  # disjoint, all used
    assert all(len(cpus) == 2 and _flags(args)["--cpu-threads"] == "2" for cpus, args in shares)
    unpinned = _plan(_pipeline(stages=2), tiny_llama, cpus=(0, 1, 2, 3), pin_cpus=False)
    (engine,) = unpinned.engines
    assert engine.cpus is None and engine.nodes[0].cpus is None
    assert _flags(engine.args)["--cpu-threads"] == _flags(engine.nodes[0].args)["--cpu-threads"] == "2"


def test_without_pipeline_parallelism_or_simulated_an_engine_is_one_process(tiny_llama):
    plan = _plan(yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text()), tiny_llama)
    assert all(not e.nodes and e.master_port == 0 and "--nnodes" not in e.args for e in plan.engines)
    # A simulated pod computes nothing: the engine refuses --nnodes with --simulate.
    simulated = _plan(_pipeline(), tiny_llama, simulate="engine_pod/sim/profiles/bench-cpu.json")
    assert all(not e.nodes and "--nnodes" not in e.args for e in simulated.engines)


def test_the_banner_shows_each_group(tiny_llama, tmp_path):
    from tessera_tools.up.runner import banner

    options = LocalOptions(models_dir=tiny_llama.parent)
    plan = build_plan(_pipeline(stages=2), options, *_ports())
    (engine,) = plan.engines
    text = banner(plan, options, tmp_path)
    assert "engine pods: 1 mixed (each a group of 2 processes, one per pipeline stage)" in text
    assert f"(leader, stage 0 of 2; the group meets at 127.0.0.1:{engine.master_port})" in text
    assert "  mixed-0-node-1  stage 1 of 2, node of mixed-0 (no gRPC)" in text


_NODE = ["engine", "--nnodes", "2", "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "x", "--master-port", "1"]


@pytest.mark.parametrize("nodes, sets, port, message", [
    ([], [None], 30000, r"needs 1 node commands and 2 CPU shares, got 0 and 1"),
    ([_NODE], [None, None], 65535, "master port 65535 leaves no port for the node channel"),
    ([["engine", "--nnodes", "2"]], [None, None], 30000, "node 1's command has no --node-rank"),
])
def test_bad_group_inputs_are_refused(nodes, sets, port, message):
    spec = validate_inference_service(_pipeline(stages=2))["spec"]
    with pytest.raises(ValueError, match=message):
        local_group(spec, "mixed", "mixed-0", ["engine"], nodes, port, sets)


# -- the group as one supervised child ------------------------------------------------------


class _FakePopen:
    def __init__(self) -> None:
        self.code: int | None = None
        self.killed = False

    def poll(self) -> int | None:
        return self.code

    def kill(self) -> None:
        self.killed = True
        self.code = -9


class _FakeProcess:
    """A ChildProcess stand-in: `stops` records the order of stop requests across processes."""

    def __init__(self, label: str, stops: list[str], obeys_sigterm: bool = True) -> None:
        self.label, self.stops, self.obeys_sigterm = label, stops, obeys_sigterm
        self.proc = _FakePopen()

    def request_stop(self) -> None:
        if self.proc.code is None:
            self.stops.append(self.label)
            if self.obeys_sigterm:
                self.proc.code = 0

    def terminate(self, timeout: float = 60.0) -> int:
        self.request_stop()
        if self.proc.code is None:
            self.proc.kill()
        return self.proc.code


class _FakeCommand:
    def __init__(self, label: str, stops: list[str], started: list[_FakeProcess], cause: str | None = None,
                 obeys_sigterm: bool = True) -> None:
        self.label, self.stops, self.started, self.cause, self.obeys = label, stops, started, cause, obeys_sigterm

    def start(self) -> _FakeProcess:
        self.started.append(_FakeProcess(self.label, self.stops, self.obeys))
        return self.started[-1]

    def bind_failure(self) -> str | None:
        return self.cause


def _group(now: list[float], stops: list[str], started: list[_FakeProcess], node_obeys: bool = True,
           node_cause: str | None = None) -> ChildGroup:
    return ChildGroup("mixed-0", [Member("leader", _FakeCommand("leader", stops, started)),
                                  Member("node 1 (mixed-0-node-1)",
                                         _FakeCommand("node", stops, started, node_cause, node_obeys))],
                      clock=lambda: now[0])


def test_a_dead_node_stops_the_leader_and_the_group_restarts_whole(caplog):
    caplog.set_level(logging.ERROR, logger="tessera_tools.up.child_group")
    now, stops, started = [0.0], [], []
    supervisor = Supervisor(clock=lambda: now[0])
    child = supervisor.add("mixed-0", _group(now, stops, started).start, stop_order=1)
    leader, node = started
    supervisor.check()
    assert child.restart_at is None and not stops
    node.proc.code = -9  # a node dies: the leader goes with it, and the group has exited
    supervisor.check()
    assert stops == ["leader"] and leader.proc.code == 0
    assert child.history == ["exited with -9"] and child.restart_at == 1.0
    assert "mixed-0: the node 1 (mixed-0-node-1) exited with -9; stopping the rest of the group (leader)" in caplog.text
    now[0] = 1.0
    supervisor.check()
    assert len(started) == 4 and all(p.proc.code is None for p in started[2:])  # leader and node again
    # Stopping the run: the leader first (it drains and shuts its nodes down), then what is left.
    supervisor.stop()
    assert stops == ["leader", "leader", "node"] and supervisor.num_stopped == 2  # each member counts


def test_a_member_that_ignores_sigterm_is_killed_before_the_group_counts_as_exited():
    now, stops, started = [0.0], [], []
    group = _group(now, stops, started, node_obeys=False).start()
    leader, node = started
    leader.proc.code = 1  # the leader fails; its node does not stop when asked
    assert group.poll() is None and stops == ["node"] and not node.proc.killed
    now[0] = STOP_GRACE_S - 0.1
    assert group.poll() is None
    now[0] = STOP_GRACE_S
    assert group.poll() is None and node.proc.killed  # killed; the group is down once it is reaped
    assert group.poll() == 1  # the first member's exit code
    assert group.first_exit == ("leader", 1)


def test_a_member_that_cannot_bind_its_port_ends_the_run_naming_it():
    now, stops, started = [0.0], [], []
    supervisor = Supervisor(clock=lambda: now[0])
    cause = "cannot listen for the other nodes on port 30001: Address already in use"
    group = _group(now, stops, started, node_cause=cause)
    supervisor.add("mixed-0", group.start, stop_order=1, fatal_cause=group.bind_failure)
    started[1].proc.code = 2
    with pytest.raises(ChildFailed, match=f"mixed-0 exited with 2: node 1 \\(mixed-0-node-1\\): {cause}"):
        supervisor.check()


def test_a_group_needs_a_leader_and_a_node():
    with pytest.raises(ValueError, match="a group has a leader and at least one node, got 1 members"):
        ChildGroup("mixed-0", [Member("leader", _FakeCommand("leader", [], []))])
