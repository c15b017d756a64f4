"""The engine group's node channel (distributed/node_channel.py): mutual
HMAC authentication, and frames that are verified before they are unpickled.
Pure tests over socket pairs and loopback; no engine."""

from __future__ import annotations

import pickle
import socket
import threading

import pytest

from engine_pod.config import NodeLayout, ParallelConfig
from engine_pod.distributed.node_channel import ChannelError, accept_node, connect_to_leader, listen

KEY = b"k" * 32
OTHER_KEY = b"o" * 32


def _pair(leader_key: bytes, node_key: bytes, node_rank: int = 1):
    """(leader's result, node's result): a channel or the ChannelError each side got."""
    listener = listen(0)
    port = listener.getsockname()[1]
    results: dict[str, object] = {}

    def leader() -> None:
        sock, address = listener.accept()
        try:
            results["leader"] = accept_node(sock, f"{address[0]}:{address[1]}", leader_key)
        except ChannelError as e:
            sock.close()
            results["leader"] = e

    thread = threading.Thread(target=leader)
    thread.start()
    import time

    try:
        results["node"] = connect_to_leader(("127.0.0.1", port), node_rank, node_key, time.monotonic() + 5)
    except ChannelError as e:
        results["node"] = e
    thread.join(10)
    listener.close()
    return results["leader"], results["node"]


def test_nodes_holding_the_key_authenticate_each_other_and_exchange_messages():
    (node_rank, leader), node = _pair(KEY, KEY, node_rank=1)
    assert node_rank == 1
    leader.send({"call": 1})
    assert pickle.loads(node.recv_payload()) == {"call": 1}
    node.send_heartbeat()
    node.send(("reply", 1, "ok"))
    assert leader.recv_payload() is None  # the heartbeat
    assert pickle.loads(leader.recv_payload()) == ("reply", 1, "ok")
    leader.close()
    node.close()


def test_a_node_with_another_key_is_refused_and_learns_it():
    leader, node = _pair(KEY, OTHER_KEY)
    assert isinstance(leader, ChannelError) and "failed authentication" in str(leader)
    assert isinstance(node, ChannelError) and "refused this node" in str(node)
    assert KEY.decode() not in str(leader) + str(node)


def _raw_channels():
    """(leader channel, node channel, the leader's raw socket) over a socket pair."""
    a, b = socket.socketpair()
    from engine_pod.distributed.node_channel import NodeChannel

    return NodeChannel(a, KEY, is_leader=True, peer="node 1"), NodeChannel(b, KEY, is_leader=False, peer="leader"), a


def test_a_tampered_frame_is_refused_before_it_is_unpickled():
    leader, node, leader_sock = _raw_channels()
    payload = pickle.dumps(("reply", 1, "ok"))
    evil = payload.replace(b"ok", b"no")
    # A frame with a valid-looking header and the MAC of another payload.
    import hashlib
    import hmac
    import struct

    mac = hmac.new(KEY, b"L>N" + struct.pack("!Q", 0) + b"\x01" + payload, hashlib.sha256).digest()
    leader_sock.sendall(struct.pack("!IB", len(evil), 1) + mac + evil)
    with pytest.raises(ChannelError, match="failed authentication"):
        node.recv_payload()


def test_a_replayed_or_reflected_frame_is_refused():
    leader, node, leader_sock = _raw_channels()
    node_sock = node.sock
    leader.send("step")
    frame = node_sock.recv(1 << 16)  # the raw frame, as a man in the middle sees it
    leader_sock.sendall(frame)
    assert pickle.loads(node.recv_payload()) == "step"
    leader_sock.sendall(frame)  # the same frame again: its sequence number is spent
    with pytest.raises(ChannelError, match="failed authentication"):
        node.recv_payload()
    # The leader's own frame sent back to it: the direction is in the MAC.
    leader2, node2, _ = _raw_channels()
    leader2.send("step")
    node2.sock.sendall(node2.sock.recv(1 << 16))
    with pytest.raises(ChannelError, match="failed authentication"):
        leader2.recv_payload()


@pytest.mark.parametrize("kwargs, message", [
    (dict(nnodes=0), "nnodes must be a positive integer"),
    (dict(nnodes=True), "nnodes must be a positive integer"),
    (dict(nnodes=2, node_rank=2, master_addr="x"), "node_rank must be in 0..nnodes-1"),
    (dict(node_rank=-1), "node_rank must be in 0..nnodes-1"),
    (dict(nnodes=2), "master_addr: required with nnodes=2"),
    (dict(master_port=0), "master_port must be in 1-65534"),
    (dict(master_port=65535), "master_port must be in 1-65534"),
    (dict(join_timeout_s=0), "join_timeout_s must be > 0"),
])
def test_bad_node_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NodeLayout(**kwargs)


def test_the_nodes_split_the_ranks_evenly():
    layout = NodeLayout(2, 1, "leader", 29500)
    assert layout.local_ranks(4) == range(2, 4)
    assert [layout.local_ranks_of(k, 4) for k in range(2)] == [range(0, 2), range(2, 4)]
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nodes=layout)
    assert parallel.local_world_size == 2
    with pytest.raises(ValueError, match="nnodes=3 does not divide the world size 4"):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nodes=NodeLayout(3, 0, "leader"))
