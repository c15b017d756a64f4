"""SIGTERM while an engine group is still joining (distributed/join_stop.py):
a leader waiting for a node that never comes, and a node waiting for a leader
that never answers, exit 0 within seconds (not at their 600 s join timeout),
say so in their log, and leave no worker process behind."""

from __future__ import annotations

import multiprocessing
import signal
import socket
import time

import pytest

from engine_pod.distributed.node_channel import MAGIC, node_channel_port
from engine_pod.server.process import EnginePodProcess, free_port
from tests.engine_pod.multinode.test_multinode_pods import _alive, _Node, _node_args, _ranks_of, _wait_exit
from tests.engine_pod.multinode.refusing_leader import refusing

# SIGTERM to exit: the join loops look several times a second, then the ranks are stopped.
PROMPT_EXIT_SECONDS = 5.0


def _master_port() -> int:
    """A free port whose next one (the node channel's) is free too."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", node_channel_port(port)))
            except OSError:
                continue
        return port


def _wait_greeted(port: int, timeout: float = 120.0) -> socket.socket:
    """A connection the leader's join loop has greeted: it is waiting for its nodes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            time.sleep(0.2)
            continue
        if sock.recv(len(MAGIC)) == MAGIC:
            return sock
        sock.close()
    raise TimeoutError("the leader never listened for its nodes")


def test_sigterm_ends_a_leader_waiting_for_a_node_that_never_comes(tiny_llama, tmp_path):
    port = _master_port()
    log = tmp_path / "leader.log"
    leader = EnginePodProcess(tiny_llama, _node_args(port, 0), log_path=log)
    try:
        peer = _wait_greeted(node_channel_port(port))  # a stalled peer, too: it must not hold the stop back
        workers = _ranks_of(leader.proc.pid)
        assert len(workers) == 1  # stage 0's rank, waiting at the rendezvous
        start = time.monotonic()
        leader.proc.send_signal(signal.SIGTERM)
        code = _wait_exit(leader, 30)
        elapsed = time.monotonic() - start
        assert code == 0, f"exit {code}: {log.read_text()}"
        assert elapsed < PROMPT_EXIT_SECONDS, f"the leader took {elapsed:.1f}s to stop"
        assert not _alive(workers), "a rank outlived its leader"
        text = log.read_text()
        assert "asked to stop while waiting for nodes [1] to join; exiting without serving" in text
        assert "Traceback" not in text
        peer.close()
    finally:
        leader.terminate(timeout=10)


def test_sigterm_ends_a_node_waiting_for_a_leader_that_never_answers(tiny_llama, tmp_path):
    """The "leader" here accepts and closes every connection (as one with no handshake slot free
    does): the node keeps dialling, and SIGTERM ends that at once."""
    port = _master_port()
    listener = socket.create_server(("127.0.0.1", node_channel_port(port)))
    log = tmp_path / "node.log"
    with refusing(listener) as dials:
        node = _Node(tiny_llama, _node_args(port, 1), log)
        try:
            deadline = time.monotonic() + 120
            while len(dials) < 2 and time.monotonic() < deadline:
                assert node.proc.poll() is None, log.read_text()
                time.sleep(0.1)
            assert len(dials) >= 2, "the node never dialled the leader"
            start = time.monotonic()
            node.proc.send_signal(signal.SIGTERM)
            code = _wait_exit(node, 30)
            assert code == 0, f"exit {code}: {log.read_text()}"
            assert time.monotonic() - start < PROMPT_EXIT_SECONDS
            assert not _ranks_of(node.proc.pid)
            assert f"node 1: asked to stop while waiting for the leader at 127.0.0.1:{node_channel_port(port)}" \
                   in log.read_text()
        finally:
            node.terminate(timeout=10)


def test_a_stop_asked_while_the_ranks_start_stops_them_at_once(tiny_llama):
    """SIGTERM after the join, while the ranks still load (minutes for a large
    checkpoint): the executor's start-up wait checks the same event."""
    from engine_pod.config import create_engine_config
    from engine_pod.distributed.join_stop import JOIN_STOP, JoinStopped
    from engine_pod.executor.multiproc import MultiProcExecutor

    config = create_engine_config(str(tiny_llama), dtype="float32", max_model_len=256, device="cpu",
                                  kv_cache_memory_bytes=16 << 20, pipeline_parallel_size=2)
    JOIN_STOP.set()
    try:
        start = time.monotonic()
        with pytest.raises(JoinStopped, match=r"asked to stop while ranks \[0, 1\] were starting"):
            MultiProcExecutor(config)
        assert time.monotonic() - start < PROMPT_EXIT_SECONDS
    finally:
        JOIN_STOP.clear()
    assert [p.name for p in multiprocessing.active_children() if p.name.startswith("tessera-rank")] == []
