"""The engine with the tiered KV store: sharing across processes, P/D,
faults, tenant isolation and offload on eviction. Greedy outputs must equal
recomputation in every case (docs/architecture.md, invariant 2)."""

from __future__ import annotations

import asyncio
import random
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_pod import LLM, SamplingParams
from engine_pod.server.process import EnginePodProcess
from kv_store.block_hash import hash_request_tokens
from tessera.internal_secret import InternalSecret
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.engine_pod.server.client import collect, greedy, pod_aio_channel, pod_channel

BLOCK = 16
ENGINE_KW = dict(dtype="float64", max_model_len=512, kv_cache_memory_bytes=16 << 20)
POD_ARGS = ["--dtype", "float64", "--max-model-len", "512", "--kv-cache-memory-bytes", str(16 << 20)]


def _prompts(n: int, seed: int, lengths=(100, 37, 250, 64)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 6000) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.fixture(scope="module")
def recomputed(tiny_llama):
    """Reference outputs without any store."""
    llm = LLM(str(tiny_llama), **ENGINE_KW)

    def run(prompts, max_tokens=12, salt=None):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens), cache_salt=salt)
        return [o.outputs[0].token_ids for o in outs]

    return run


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _generate(llm, prompts, max_tokens=12, salt=None):
    return llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens), cache_salt=salt)


def _metric(pod, name, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def _full_prompt_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK


def test_second_pod_loads_the_first_pods_blocks_from_redis(tiny_llama, recomputed, tmp_path):
    """Through a password-protected Redis whose URL reaches the pods by
    environment: no credential in any pod process's argv (/proc/*/cmdline
    is world-readable)."""
    from kv_store.local_redis import RedisServer
    from kv_store.redis_tier import REDIS_URL_ENV
    from tests.conftest import TEST_INTERNAL_SECRET

    prompts = _prompts(3, seed=1)
    server = RedisServer(tmp_path, password="hunter2-redis-pw")
    env = {REDIS_URL_ENV: server.url}
    requests = [greedy(p, 12) for p in prompts]

    async def run(pod):
        async with pod_aio_channel(pod.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            results = []
            for r in requests:  # one at a time, so each prompt's blocks are written before the next pod reads
                cached = 0
                tokens = []
                async for resp in stub.Generate(r):
                    tokens += resp.token_ids
                    cached = max(cached, resp.num_cached_tokens)
                results.append((tokens, cached))
            return results

    try:
        with EnginePodProcess(tiny_llama, POD_ARGS, env=env, log_path=tmp_path / "a.log") as pod_a:
            pod_a.wait_serving()
            first = asyncio.run(run(pod_a))
            for pid in [pod_a.proc.pid, *_descendants(pod_a.proc.pid)]:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                assert b"hunter2" not in cmdline and TEST_INTERNAL_SECRET.encode() not in cmdline, pid
        # Pod A shut down (flushing its write-behind queue); pod B starts empty.
        with EnginePodProcess(tiny_llama, POD_ARGS, env=env, log_path=tmp_path / "b.log") as pod_b:
            pod_b.wait_serving()
            second = asyncio.run(run(pod_b))
            redis_hits = _metric(pod_b, "tessera_kv_store_hits_total", tier="redis")
            read_bytes = _metric(pod_b, "tessera_kv_store_read_bytes_total", tier="redis")
            loads = _metric(pod_b, "tessera_kv_store_load_seconds_count")
            lookups = _metric(pod_b, "tessera_kv_store_lookups_total")
            rejected = _metric(pod_b, "tessera_kv_store_rejected_values_total", tier="redis", reason="mac")
    finally:
        server.stop()
    expected = recomputed(prompts)
    assert [t for t, _ in first] == expected
    assert [t for t, _ in second] == expected
    assert [c for _, c in first] == [0, 0, 0]
    assert [c for _, c in second] == [_full_prompt_blocks(p) * BLOCK for p in prompts]
    assert redis_hits == lookups == sum(_full_prompt_blocks(p) for p in prompts)
    assert loads == 3 and read_bytes > redis_hits * 1000 and rejected == 0
    assert "hunter2" not in (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()


def test_prefill_and_decode_pods_match_mixed_mode(tiny_llama, redis_server, recomputed, tmp_path):
    prompts = _prompts(4, seed=2, lengths=(100, 250, 37, 200))  # none a multiple of the block size
    redis_args = ["--kv-redis-url", redis_server.url]
    with EnginePodProcess(tiny_llama, POD_ARGS + redis_args + ["--role", "prefill"],
                          log_path=tmp_path / "p.log") as prefill, \
         EnginePodProcess(tiny_llama, POD_ARGS + redis_args + ["--role", "decode"],
                          log_path=tmp_path / "d.log") as decode:
        prefill.wait_serving()
        decode.wait_serving()

        async def run():
            async with pod_aio_channel(prefill.address) as pch, pod_aio_channel(decode.address) as dch:
                pstub, dstub = pb_grpc.EngineStub(pch), pb_grpc.EngineStub(dch)
                out = []
                for p in prompts:
                    produce = greedy(p, 12)
                    produce.kv_transfer.mode = pb.KVTransferParams.MODE_PRODUCE
                    first, reason = await collect(pstub, produce)
                    assert len(first) == 1 and reason == "length"
                    consume = greedy(p, 12)
                    consume.kv_transfer.mode = pb.KVTransferParams.MODE_CONSUME
                    tokens, cached = [], 0
                    async for resp in dstub.Generate(consume):
                        tokens += resp.token_ids
                        cached = max(cached, resp.num_cached_tokens)
                    out.append((first, tokens, cached))
                return out

        results = asyncio.run(run())
    expected = recomputed(prompts)
    for p, (first, tokens, cached), ref in zip(prompts, results, expected):
        assert tokens == ref
        assert first == ref[:1]
        assert len(p) - cached < BLOCK  # the decode pod computed less than a block of the prompt


def test_pd_modes_are_checked_against_the_role(tiny_llama, redis_server, tmp_path):
    args = POD_ARGS + ["--kv-redis-url", redis_server.url, "--role", "decode"]
    with EnginePodProcess(tiny_llama, args, log_path=tmp_path / "d.log") as pod:
        pod.wait_serving()
        request = greedy([5, 6, 7], 2)
        request.kv_transfer.mode = pb.KVTransferParams.MODE_PRODUCE
        with pod_channel(pod.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.EngineStub(channel).Generate(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "decode pod" in info.value.details()


def test_redis_killed_mid_run_changes_nothing(tiny_llama, redis_server, recomputed):
    prompts = _prompts(6, seed=3)
    llm = LLM(str(tiny_llama), **ENGINE_KW, kv_redis_url=redis_server.url)
    assert _tokens(_generate(llm, prompts[:3])) == recomputed(prompts[:3])
    redis_server.stop()
    fresh = LLM(str(tiny_llama), **ENGINE_KW, kv_redis_url=redis_server.url)  # starts with Redis gone
    assert _tokens(_generate(llm, prompts)) == recomputed(prompts)
    assert _tokens(_generate(fresh, prompts)) == recomputed(prompts)
    assert llm.engine_core.kv_store.remote.errors >= 1
    assert not fresh.engine_core.kv_store.remote.available


def _forge(kind: str, value: bytes, other_value: bytes, codec) -> bytes:
    """A value planted under a block's key; all but truncation carry another
    block's KV, so accepting one would change the greedy tokens."""
    from kv_store.codec import HEADER_SIZE, BlockCodec

    forged_payload = value[:HEADER_SIZE] + other_value[HEADER_SIZE:]  # the header (and MAC) kept
    if kind == "forged":
        return forged_payload
    if kind == "other-deployment":  # signed, but with another deployment's key
        other_key = InternalSecret.from_text("another-deployment-secret-0123456789").kv_mac_key
        return BlockCodec(codec.layout, other_key).sign(forged_payload)
    if kind == "truncated":
        return value[: len(value) // 2]
    assert kind == "misaddressed"  # a genuine value copied under another block's key
    return other_value


def test_forged_replayed_truncated_and_misaddressed_values_never_change_a_token(tiny_llama, redis_server,
                                                                                recomputed):
    kinds = ["forged", "other-deployment", "truncated", "misaddressed"]
    prompts = _prompts(len(kinds), seed=4)
    writer = LLM(str(tiny_llama), **ENGINE_KW, kv_redis_url=redis_server.url)
    _generate(writer, prompts)
    store = writer.engine_core.kv_store
    store.flush()
    # Every key of prompt i gets forgery i; the values copied in come from
    # another prompt's blocks (prompt i + 1's first block).
    hashes = [hash_request_tokens(p, BLOCK)[: _full_prompt_blocks(p)] for p in prompts]
    keys = [[store.remote.key(h) for h in hs] for hs in hashes]
    originals = {k: redis_server.client.get(k) for ks in keys for k in ks}
    assert all(originals.values())
    for i, kind in enumerate(kinds):
        other = originals[keys[(i + 1) % len(kinds)][0]]
        for key in keys[i]:
            redis_server.client.set(key, _forge(kind, originals[key], other, store.codec))
    reader = LLM(str(tiny_llama), **ENGINE_KW, kv_redis_url=redis_server.url)
    assert _tokens(_generate(reader, prompts)) == recomputed(prompts)
    rstore = reader.engine_core.kv_store
    assert rstore.stats.redis_hits == 0 and reader.stats.external_prefix_hits == 0
    # Each prompt's run stops at its first block: one refusal each.
    assert dict(rstore.stats.rejected) == {("redis", "mac"): 2, ("redis", "truncated"): 1,
                                           ("redis", "misaddressed"): 1}
    # Deleted on detection (tests/kv_store/test_tiered_store.py checks the delete
    # itself); the reader then saved freshly computed blocks, so every key
    # holds a genuine value again.
    rstore.flush()
    for hs, ks in zip(hashes, keys):
        for h, key in zip(hs, ks):
            rstore.codec.decode(h, redis_server.client.get(key))


def test_the_redis_tier_needs_the_internal_secret(tiny_llama, redis_server, monkeypatch, tmp_path):
    from engine_pod.config import create_engine_config

    monkeypatch.delenv("TESSERA_INTERNAL_SECRET", raising=False)
    monkeypatch.delenv("TESSERA_INTERNAL_SECRET_FILE", raising=False)
    url = redis_server.url.replace("redis://", "redis://:hunter2-pw@")
    with pytest.raises(ValueError) as info:
        create_engine_config(tiny_llama, kv_redis_url=url)
    message = str(info.value)
    assert "TESSERA_INTERNAL_SECRET_FILE" in message and "TESSERA_INTERNAL_SECRET" in message
    assert "hunter2" not in message and str(redis_server.port) not in message
    # An explicit key, or the secret in a file, will do.
    assert create_engine_config(tiny_llama, kv_redis_url=url, kv_mac_key=b"k" * 32).kv_store.mac_key == b"k" * 32
    secret_file = tmp_path / "internal-secret"
    secret_file.write_text("a-secret-from-a-mounted-file-0123456789\n")
    monkeypatch.setenv("TESSERA_INTERNAL_SECRET_FILE", str(secret_file))
    config = create_engine_config(tiny_llama, kv_redis_url=url)
    assert config.kv_store.mac_key == InternalSecret.from_file(secret_file).kv_mac_key
    assert "hunter2" not in repr(config)


def test_cache_salts_never_share_across_any_tier(tiny_llama, redis_server, recomputed):
    prompt = _prompts(1, seed=5, lengths=(200,))
    a = LLM(str(tiny_llama), **ENGINE_KW, kv_redis_url=redis_server.url, kv_host_bytes=32 << 20)
    _generate(a, prompt, salt="tenant-a")
    a.engine_core.kv_store.flush()
    # Same engine (device cache and host tier warm), other salt: no hit anywhere.
    out = _generate(a, prompt, salt="tenant-b")
    assert out[0].num_cached_tokens == 0
    # Another engine, a salt never served, only Redis in common: no hit.
    b = LLM(str(tiny_llama), **ENGINE_KW, kv_redis_url=redis_server.url)
    out_b = _generate(b, prompt, salt="tenant-c")
    assert out_b[0].num_cached_tokens == 0 and b.stats.external_prefix_hits == 0
    assert _tokens(out_b) == recomputed(prompt, salt="tenant-c")
    # The same salt does hit.
    c = LLM(str(tiny_llama), **ENGINE_KW, kv_redis_url=redis_server.url)
    assert _generate(c, prompt, salt="tenant-a")[0].num_cached_tokens == _full_prompt_blocks(prompt[0]) * BLOCK


def test_prefix_evicted_from_the_device_comes_back_from_the_host_tier(tiny_llama, recomputed):
    # A pool of 40 blocks; a 200-token prefix takes 13. Other traffic then
    # evicts it from the device pool.
    llm = LLM(str(tiny_llama), dtype="float64", max_model_len=512, num_gpu_blocks=40, kv_host_bytes=64 << 20)
    store = llm.engine_core.kv_store
    target = _prompts(1, seed=6, lengths=(200,))
    _generate(llm, target)
    # Empty the host tier, so what it holds next can only come from the
    # offload of blocks evicted from the device pool.
    for h in store.host.lru_order():
        store.host.delete(h)
    _generate(llm, _prompts(6, seed=7, lengths=(150, 180)))
    pool = llm.engine_core.scheduler.kv_cache_manager.block_pool
    target_hashes = hash_request_tokens(target[0], BLOCK)
    assert store.host.num_leading_hits(target_hashes) >= 1  # offloaded when evicted from the device
    hits_before = store.stats.host_hits
    out = _generate(llm, target)
    assert store.stats.host_hits - hits_before >= 1
    assert llm.stats.external_prefix_hits > 0
    assert out[0].num_cached_tokens == _full_prompt_blocks(target[0]) * BLOCK
    assert _tokens(out) == recomputed(target)
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_pod_starts_and_serves_with_redis_unreachable(tiny_llama, tmp_path, recomputed):
    from tessera.child_process import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"
    prompts = _prompts(2, seed=8)
    with EnginePodProcess(tiny_llama, POD_ARGS + ["--kv-redis-url", dead], log_path=tmp_path / "pod.log") as pod:
        pod.wait_serving()
        results = asyncio.run(_collect_all(pod.address, [greedy(p, 12) for p in prompts]))
        assert _metric(pod, "tessera_kv_store_redis_up") == 0
        assert _metric(pod, "tessera_kv_store_redis_errors_total") >= 1
    assert [t for t, _ in results] == recomputed(prompts)
    assert "unreachable" in (tmp_path / "pod.log").read_text()


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def test_a_bad_redis_url_is_refused_without_echoing_its_password(tiny_llama, monkeypatch, capsys, caplog):
    """`tessera engine` in this process (its start-up fails before any model loads)."""
    from kv_store.redis_tier import REDIS_URL_ENV
    from tessera_tools.cli import main

    monkeypatch.setenv(REDIS_URL_ENV, "http://user:hunter2-redis-pw@redis:6379/0")
    assert main(["engine", "--model", str(tiny_llama), "--metrics-port", "0"]) == 2
    out = capsys.readouterr()
    assert "kv_redis_url" in out.err and "'http'" in out.err
    assert "hunter2" not in out.err + out.out + caplog.text


async def _collect_all(address, requests):
    async with pod_aio_channel(address) as channel:
        stub = pb_grpc.EngineStub(channel)
        return [await collect(stub, r) for r in requests]


def test_kv_store_needs_prefix_caching(tiny_llama):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(str(tiny_llama), **ENGINE_KW, kv_host_bytes=1 << 20, enable_prefix_caching=False)
