"""The settings the nodes of a multi-node engine must share (group_identity.py)."""

from __future__ import annotations

from engine_pod.config import create_engine_config
from engine_pod.executor.group_identity import group_identity, identity_differences


def _identity(model, **kw) -> dict[str, str]:
    return group_identity(create_engine_config(str(model), device="cpu", kv_cache_memory_bytes=16 << 20, **kw))


def test_the_same_settings_agree_and_each_difference_is_named(tiny_llama, tiny_qwen2):
    leader = _identity(tiny_llama, dtype="float32", max_model_len=256)
    assert identity_differences(leader, _identity(tiny_llama, dtype="float32", max_model_len=256)) == []
    assert identity_differences(leader, _identity(tiny_llama, dtype="float64", max_model_len=256)) == [
        "dtype: torch.float32 != torch.float64"]
    other_model = identity_differences(leader, _identity(tiny_qwen2, dtype="float32", max_model_len=256))
    assert any(d.startswith("model config.json sha256: ") for d in other_model)
    layout = identity_differences(_identity(tiny_llama, pipeline_parallel_size=2),
                                  _identity(tiny_llama, pipeline_parallel_size=2, tensor_parallel_size=2))
    assert layout == ["tensor_parallel_size: 1 != 2"]


def test_a_setting_only_one_side_has_is_a_difference():
    assert identity_differences({"a": "1"}, {"a": "1", "b": "2"}) == ["b: (absent) != 2"]


def _channels():
    """(leader channel, node channel) over a socket pair."""
    import socket

    from engine_pod.distributed.node_channel import NodeChannel

    a, b = socket.socketpair()
    key = b"k" * 32
    return NodeChannel(a, key, is_leader=True, peer="node 1"), NodeChannel(b, key, is_leader=False, peer="leader")


def test_a_node_checks_the_leaders_identity_and_names_what_differs(tiny_llama):
    import pickle

    from engine_pod.executor.node_follower import check_identity

    config = create_engine_config(str(tiny_llama), device="cpu", kv_cache_memory_bytes=16 << 20, max_model_len=256)
    leader, node = _channels()
    leader.send(("identity", group_identity(config)))
    assert check_identity(node, config) is None

    leader, node = _channels()
    leader.send(("identity", _identity(tiny_llama, max_model_len=128)))
    refusal = check_identity(node, config)
    assert refusal is not None and "max_model_len: 128 != 256" in refusal
    assert pickle.loads(leader.recv_payload()) == ("refused", -1, refusal)  # the leader learns why


def test_a_leader_that_only_heartbeats_is_left_at_the_identity_deadline(tiny_llama):
    """Something that authenticates as the leader (it holds the key) but never
    sends its identity: the node gives up at the deadline instead of waiting forever."""
    import threading
    import time

    from engine_pod.executor.node_follower import check_identity

    config = create_engine_config(str(tiny_llama), device="cpu", kv_cache_memory_bytes=16 << 20)
    leader, node = _channels()
    done = threading.Event()

    def heartbeats_only() -> None:
        while not done.wait(0.1):
            leader.send_heartbeat()

    threading.Thread(target=heartbeats_only, daemon=True).start()
    try:
        start = time.monotonic()
        refusal = check_identity(node, config, timeout_s=0.5)
        assert time.monotonic() - start < 2
        assert refusal == "the leader sent no identity (nothing but heartbeats for 0.5s)"
    finally:
        done.set()
