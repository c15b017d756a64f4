"""StreamLoad(prefix_cache_keys=True): pods push their prefix cache's block
keys, the whole set first and then what changed, so the gateway can match
prompts against every pod's cache without asking (proto: PrefixCacheKeys)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_pod.core.prefix_cache_keys import PrefixCacheKeyLog
from engine_pod.server import prefix_cache_feed
from engine_pod.server.prefix_cache_feed import PrefixCacheFeed
from engine_pod.server.process import SimulatedPodsProcess
from kv_store.block_hash import block_key, hash_request_tokens
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.engine_pod.server.client import generate_all, greedy, pod_channel

BS = 16
NUM_BLOCKS = 12
POD_ARGS = ["--max-model-len", "128", "--num-gpu-blocks", str(NUM_BLOCKS), "--drain-timeout", "1"]
SALT = "tenant-a"


def keys(token_ids, salt=None):
    return {block_key(h) for h in hash_request_tokens(token_ids, BS, salt)}


# The pod's warm-up request (engine_pod/server/main.py: _warm_up) leaves one block cached.
WARMUP_KEYS = keys([0] * 16)


class KeyStream:
    """One StreamLoad subscriber, applying the pushed keys as a gateway would."""

    def __init__(self, address: str, interval_ms: int = 20) -> None:
        self.channel = pod_channel(address)
        request = pb.LoadRequest(prefix_cache_keys=True, interval_ms=interval_ms)
        self.reports = pb_grpc.EngineStub(self.channel).StreamLoad(request, timeout=60)
        self.keys: set[int] = set()
        self.ever_stored: set[int] = set()
        self.removed: set[int] = set()
        self.resets = 0

    def read(self) -> pb.LoadReport:
        report = next(self.reports)
        assert report.HasField("prefix_cache") and report.num_kv_blocks == NUM_BLOCKS and report.block_size == BS
        pushed = report.prefix_cache
        if pushed.reset:
            self.resets += 1
            self.keys = set()
        assert not set(pushed.stored) & set(pushed.removed)
        self.keys = (self.keys - set(pushed.removed)) | set(pushed.stored)
        self.ever_stored |= set(pushed.stored)
        self.removed |= set(pushed.removed)
        return report

    def read_until(self, done, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self):
            assert time.monotonic() < deadline, f"keys now: {sorted(self.keys)}"
            self.read()

    def close(self) -> None:
        self.reports.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def sim_pods(tiny_llama, fast_sim_profile, tmp_path_factory):
    log = tmp_path_factory.mktemp("sim") / "pods.log"
    with SimulatedPodsProcess(tiny_llama, fast_sim_profile, 2, POD_ARGS, log_path=log) as pods:
        pods.wait_serving()
        yield pods


def test_pods_push_stored_and_evicted_keys(sim_pods):
    address = sim_pods.addresses[0]
    first = KeyStream(address)
    try:
        assert first.read().prefix_cache.reset and first.keys == WARMUP_KEYS

        prompt = list(range(1000, 1064))  # four full blocks
        request = greedy(prompt, 4, ignore_eos=True)
        request.cache_salt = SALT
        [(output, _)] = asyncio.run(generate_all(address, [request]))
        cached = keys(prompt + output, SALT)
        assert keys(prompt, SALT) <= cached and len(cached) == 4
        first.read_until(lambda s: cached <= s.keys)
        assert first.ever_stored == WARMUP_KEYS | cached and first.resets == 1

        # 12 blocks: two more 5-block requests reuse the first one's freed blocks.
        others = [list(range(3000, 3064)), list(range(4000, 4064))]
        for other in others:
            asyncio.run(generate_all(address, [greedy(other, 4, ignore_eos=True)]))
        first.read_until(lambda s: s.removed & cached)
        assert first.removed <= first.ever_stored and first.resets == 1

        # A later subscriber starts from a snapshot equal to what the first accumulated.
        second = KeyStream(address)
        try:
            assert second.read().prefix_cache.reset
            first.read_until(lambda s: s.keys == second.keys)
            assert second.keys and second.keys - WARMUP_KEYS <= first.ever_stored
        finally:
            second.close()
    finally:
        first.close()


def test_each_pod_pushes_its_own_cache(sim_pods):
    prompt = list(range(5000, 5040))
    asyncio.run(generate_all(sim_pods.addresses[0], [greedy(prompt, 2)]))
    other = KeyStream(sim_pods.addresses[1])
    try:
        other.read()
        assert other.keys == WARMUP_KEYS
    finally:
        other.close()


def test_without_the_flag_reports_carry_no_keys(sim_pods):
    with pod_channel(sim_pods.addresses[0]) as channel:
        stub = pb_grpc.EngineStub(channel)
        reports = stub.StreamLoad(pb.LoadRequest(interval_ms=20), timeout=10)
        try:
            assert not next(reports).HasField("prefix_cache")
        finally:
            reports.cancel()
        assert not stub.GetLoad(pb.LoadRequest(prefix_cache_keys=True), timeout=5).HasField("prefix_cache")


# -- the feed: snapshots, chunks, resyncs ----------------------------------------


def filled_log(n: int, max_changes: int = 1000) -> PrefixCacheKeyLog:
    log = PrefixCacheKeyLog(max_changes=max_changes)
    for h in hash_request_tokens(list(range(n)), 1):
        log.stored(h)
    return log


def apply(messages, known: set[int]) -> set[int]:
    for m in messages:
        known = set() if m.reset else known
        known = (known - set(m.removed)) | set(m.stored)
    return known


def test_a_large_set_is_split_and_only_the_first_chunk_resets(monkeypatch):
    monkeypatch.setattr(prefix_cache_feed, "MAX_KEYS_PER_REPORT", 3)
    log = filled_log(8)
    feed = PrefixCacheFeed()
    messages = feed.next_messages(log)
    assert [m.reset for m in messages] == [True, False, False]
    assert [len(m.stored) for m in messages] == [3, 3, 2]
    assert apply(messages, {123}) == set(log.snapshot()[1])
    # Then only the changes, split the same way.
    for h in hash_request_tokens(list(range(100, 105)), 1):
        log.stored(h)
    changes = feed.next_messages(log)
    assert [m.reset for m in changes] == [False, False] and [len(m.stored) for m in changes] == [3, 2]
    assert feed.next_messages(log) == [pb.PrefixCacheKeys()]


def test_a_feed_that_fell_off_the_log_or_saw_a_clear_resets():
    log = filled_log(2, max_changes=4)
    feed = PrefixCacheFeed()
    known = apply(feed.next_messages(log), set())
    for h in hash_request_tokens(list(range(100, 110)), 1):  # more changes than the log keeps
        log.stored(h)
    resync = feed.next_messages(log)
    assert resync[0].reset and apply(resync, known) == set(log.snapshot()[1])
    log.cleared()
    assert feed.next_messages(log) == [pb.PrefixCacheKeys(reset=True)]


def test_no_engine_yet_is_an_empty_set_and_a_new_log_resets():
    feed = PrefixCacheFeed(max_keys_per_report=10)
    assert feed.next_messages(None) == [pb.PrefixCacheKeys(reset=True)]
    first, second = filled_log(3), filled_log(5)
    assert feed.next_messages(first)[0].reset
    assert feed.next_messages(first) == [pb.PrefixCacheKeys()]
    [message] = feed.next_messages(second)
    assert message.reset and len(message.stored) == 5
