"""One engine's ranks over two `tessera engine` processes (issue 25, point 2):
the leader (--node-rank 0: engine core, gRPC) and a node (--node-rank 1:
only its ranks), PP=2, one stage each, on loopback with gloo. They serve the
offline engine's greedy tokens; a killed node or leader ends the other within
seconds, leaving no worker process; a node with another secret never joins."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from engine_pod import LLM, SamplingParams
from engine_pod.server.process import EnginePodProcess, free_port
from tessera.child_process import ChildProcess
from tests.engine_pod.server.client import generate_all, greedy, scrape_metrics
from tests.engine_pod.server.conftest import POD_ARGS

PROMPTS = [[11, 12, 13], list(range(100, 140))]
MAX_TOKENS = [8, 6]
OTHER_SECRET = "another-deployment-secret-0123456789abcdef"


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return found


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except FileNotFoundError:
            continue
    return alive


def _node_args(master_port: int, node_rank: int) -> list[str]:
    return [*POD_ARGS, "--pipeline-parallel-size", "2", "--cpu-threads", "1", "--nnodes", "2",
            "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port)]


class _Node(ChildProcess):
    """`tessera engine --node-rank K` (K > 0): no gRPC port, only its ranks."""

    def __init__(self, model: Path, args: list[str], log_path: Path, env: dict | None = None) -> None:
        self.log_path = log_path
        super().__init__(["engine", "--model", str(model), *args], env, log_path)


def _start_group(model: Path, tmp_path: Path, node_env: dict | None = None) -> tuple[EnginePodProcess, _Node]:
    port = free_port()
    leader = EnginePodProcess(model, _node_args(port, 0), log_path=tmp_path / "leader.log")
    node = _Node(model, _node_args(port, 1), tmp_path / "node.log", node_env)
    return leader, node


def _wait_exit(proc: ChildProcess, timeout: float) -> int | None:
    try:
        return proc.proc.wait(timeout)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
        return None


@pytest.fixture(scope="module")
def expected(tiny_llama):
    with LLM(str(tiny_llama), dtype="float64", max_model_len=256, kv_cache_memory_bytes=32 << 20) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS])
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("victim", ["node", "leader"])
def test_two_nodes_serve_offline_tokens_and_a_killed_one_ends_the_group(tiny_llama, tmp_path, expected, victim):
    leader, node = _start_group(tiny_llama, tmp_path)
    try:
        leader.wait_serving(timeout=120)
        got = asyncio.run(generate_all(leader.address, [greedy(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]))
        assert got == expected
        # Each process's ranks are its children (the resource tracker may be one too).
        workers = _children(leader.proc.pid) + _children(node.proc.pid)
        assert len(workers) >= 2
        killed, survivor = (node, leader) if victim == "node" else (leader, node)
        start = time.monotonic()
        killed.proc.send_signal(signal.SIGKILL)
        code = _wait_exit(survivor, 10)
        elapsed = time.monotonic() - start
        assert code is not None and code != 0, f"the {victim}'s peer did not exit non-zero within 10s ({code})"
        assert elapsed < 10
        deadline = time.monotonic() + 5
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(workers), "a worker outlived its group"
        log = (tmp_path / ("leader.log" if victim == "node" else "node.log")).read_text()
        assert ("lost node 1" if victim == "node" else "lost the leader") in log
    finally:
        node.terminate(timeout=10)
        leader.terminate(timeout=10)


def test_a_node_with_another_secret_never_joins(tiny_llama, tmp_path):
    leader, node = _start_group(tiny_llama, tmp_path, node_env={"TESSERA_INTERNAL_SECRET": OTHER_SECRET})
    try:
        code = _wait_exit(node, 30)
        assert code is not None and code != 0
        node_log = (tmp_path / "node.log").read_text()
        assert "refused this node" in node_log
        assert OTHER_SECRET not in node_log
        time.sleep(0.5)
        leader_log = (tmp_path / "leader.log").read_text()
        assert "failed authentication" in leader_log
        assert "joined" not in leader_log
        # The leader keeps waiting for a legitimate node (within its join timeout), not serving.
        assert leader.proc.poll() is None
        assert leader.health() != 1  # SERVING
        assert not [line for line in leader_log.splitlines() if "workers ready" in line]
        # A leader still starting up does not drain: killed, its ranks follow it.
        workers = _children(leader.proc.pid)
        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait(10)
        deadline = time.monotonic() + 5
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(workers)
    finally:
        node.terminate(timeout=10)
        leader.terminate(timeout=10)


def _ranks_of(pid: int) -> list[int]:
    """The worker processes among ``pid``'s children (not the resource tracker)."""
    ranks = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    ranks.append(child)
        except FileNotFoundError:
            continue
    return ranks


def test_a_rank_killed_on_the_node_mid_request_fails_the_leader_naming_node_and_rank(tiny_llama, tmp_path):
    leader, node = _start_group(tiny_llama, tmp_path)
    try:
        leader.wait_serving(timeout=120)

        async def run():
            from tests.engine_pod.server.client import pod_aio_channel
            from tessera.v1 import engine_pb2_grpc as pb_grpc

            async with pod_aio_channel(leader.address) as channel:
                call = pb_grpc.EngineStub(channel).Generate(greedy([5] * 20, 240, ignore_eos=True))
                await call.read()
                (rank,) = _ranks_of(node.proc.pid)
                os.kill(rank, signal.SIGKILL)
                with pytest.raises(Exception):  # noqa: B017 - the stream ends in an error, whichever
                    while True:
                        await call.read()

        workers = _children(leader.proc.pid) + _children(node.proc.pid)
        start = time.monotonic()
        asyncio.run(run())
        assert (_wait_exit(leader, 10), _wait_exit(node, 10)) != (None, None)
        assert leader.proc.returncode not in (None, 0) and node.proc.returncode not in (None, 0)
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 5
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(workers)
        assert "pipeline-parallel worker rank 1 (stage 1, node 1)" in (tmp_path / "leader.log").read_text()
    finally:
        node.terminate(timeout=10)
        leader.terminate(timeout=10)


def test_the_leaders_metrics_show_the_nodes_stage_and_sigterm_stops_the_group_cleanly(tiny_llama, tmp_path, expected):
    """Stage 1 runs on the node: its figures reach the leader's /metrics with the
    node's heartbeats. Then a drained leader shuts its node down: both exit 0, and
    the node closing its link after the shutdown is not a lost node (a rollout is
    not a failure)."""
    leader, node = _start_group(tiny_llama, tmp_path)
    try:
        leader.wait_serving(timeout=120)
        got = asyncio.run(generate_all(leader.address, [greedy(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]))
        assert got == expected
        deadline = time.monotonic() + 5  # a heartbeat a second carries the node's figures
        steps: dict[str, float] = {}
        while time.monotonic() < deadline and steps.get("1", 0.0) < max(MAX_TOKENS):
            samples = scrape_metrics(leader)
            steps = {labels[0][1]: v for (name, labels), v in samples.items()
                     if name == "tessera_pipeline_stage_steps_total"}
            time.sleep(0.2)
        # Every decode step ran on both stages.
        assert steps.get("0", 0.0) >= max(MAX_TOKENS) and steps.get("1", 0.0) >= max(MAX_TOKENS), steps
        assert samples[("tessera_pipeline_stage_busy_seconds_total", (("stage", "1"),))] > 0.0
        leader.proc.send_signal(signal.SIGTERM)
        leader_code, node_code = _wait_exit(leader, 30), _wait_exit(node, 30)
        text = (tmp_path / "leader.log").read_text()
        logs = f"leader:\n{text}\nnode:\n{(tmp_path / 'node.log').read_text()}"
        assert (leader_code, node_code) == (0, 0), logs
        assert "lost node" not in text, logs
    finally:
        node.terminate(timeout=10)
        leader.terminate(timeout=10)


def test_a_node_with_other_settings_fails_the_group_at_once_naming_them(tiny_llama, tmp_path):
    """A node started from another revision (here another --max-model-len): it
    refuses to join before starting a rank, and the leader fails naming the setting."""
    port = free_port()
    leader = EnginePodProcess(tiny_llama, _node_args(port, 0), log_path=tmp_path / "leader.log")
    other = [a if a != "256" else "128" for a in _node_args(port, 1)]  # POD_ARGS' --max-model-len 256
    node = _Node(tiny_llama, other, tmp_path / "node.log")
    try:
        start = time.monotonic()
        node_code, leader_code = _wait_exit(node, 60), _wait_exit(leader, 60)
        elapsed = time.monotonic() - start
        leader_log = (tmp_path / "leader.log").read_text()
        assert node_code == 1 and leader_code not in (None, 0), leader_log
        assert elapsed < 60
        assert "node 1 (ranks 1-1) refused to join" in leader_log
        assert "max_model_len: 256 != 128" in leader_log
        assert "max_model_len: 256 != 128" in (tmp_path / "node.log").read_text()
    finally:
        node.terminate(timeout=10)
        leader.terminate(timeout=10)
