"""The direct P/D channel between real pod processes: a prefill pod pushes a
request's blocks to the decode pod its request names (PushKVBlocks), whose
inbox serves them to the decode request; Redis is the fallback when a push
fails. Every pushed value is verified when read, as a Redis value is.

Simulated pods (no torch) cover the channel's mechanics and faults fast;
real pods at mixed TP degrees are checked against Hugging Face.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import grpc
import pytest

from engine_pod.server.process import EnginePodProcess, SimulatedPodsProcess, free_port
from engine_pod.sim.tokens import simulated_output
from kv_store.block_hash import hash_request_tokens
from kv_store.codec import HEADER_SIZE
from tessera.text import load_eos_token_ids
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.engine_pod.server.client import greedy, pod_aio_channel, pod_channel, scrape_metrics

BLOCK = 16
SIM_ARGS = ["--max-model-len", "512", "--num-gpu-blocks", "128", "--drain-timeout", "5"]
INBOX = ["--kv-inbox-bytes", str(64 << 20)]
# tiny: 4 layers, 2 KV heads of 64, float32 in a simulated pod.
SIM_VALUE_BYTES = HEADER_SIZE + 2 * 4 * 2 * 64 * BLOCK * 4


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    from kv_store.local_redis import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("direct-redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sim_pods(tiny_llama, fast_sim_profile, redis, tmp_path_factory):
    """A prefill pod, a decode pod with an inbox, one without, and one with an
    inbox socket (the fast data path; the first decode pod takes pushes over gRPC)."""
    work = tmp_path_factory.mktemp("direct-sim")
    store = ["--kv-redis-url", redis.url]

    def pods(name, args):
        return SimulatedPodsProcess(tiny_llama, fast_sim_profile, 1, SIM_ARGS + store + args,
                                    log_path=work / f"{name}.log")

    with pods("prefill", ["--role", "prefill", "--kv-direct-timeout", "5"]) as prefill, \
         pods("decode", ["--role", "decode", *INBOX]) as decode, \
         pods("decode-no-inbox", ["--role", "decode"]) as closed, \
         pods("decode-socket", ["--role", "decode", *INBOX, "--kv-inbox-port", str(free_port())]) as socket_pod:
        for p in (prefill, decode, closed, socket_pod):
            p.wait_serving()
        yield prefill, decode, closed, socket_pod


def _metrics(pods) -> dict:
    return scrape_metrics(SimpleNamespace(metrics_port=pods.metrics_ports[0]))


def _grew(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def _produce(address: str, prompt: list[int], target: str, request_id: str = "") -> list[int]:
    async with pod_aio_channel(address) as channel:
        produce = greedy(prompt, 4, request_id=request_id)
        produce.kv_transfer.mode = pb.KVTransferParams.MODE_PRODUCE
        produce.kv_transfer.direct_target = target
        return [t async for resp in pb_grpc.EngineStub(channel).Generate(produce, timeout=60) for t in resp.token_ids]


async def _consume(address: str, prompt: list[int], max_tokens: int,
                   mode=pb.KVTransferParams.MODE_CONSUME) -> tuple[list[int], int]:
    async with pod_aio_channel(address) as channel:
        consume = greedy(prompt, max_tokens)
        consume.kv_transfer.mode = mode
        tokens, cached = [], 0
        async for resp in pb_grpc.EngineStub(channel).Generate(consume, timeout=60):
            tokens += resp.token_ids
            cached = max(cached, resp.num_cached_tokens)
        return tokens, cached


def _pd(prefill: str, decode: str, prompt: list[int], max_tokens: int, target: str) -> tuple[list[int], int]:
    async def run():
        await _produce(prefill, prompt, target)
        return await _consume(decode, prompt, max_tokens)

    return asyncio.run(run())


def _measured_pd(prefill, decode, prompt: list[int], max_tokens: int, target: str):
    """_pd between two simulated pods, with how much a metric grew on each: the
    decode pod's tokens, its cached tokens, grew(pod, name, **labels)."""
    before = {"prefill": _metrics(prefill), "decode": _metrics(decode)}
    tokens, cached = _pd(prefill.addresses[0], decode.addresses[0], prompt, max_tokens, target)
    after = {"prefill": _metrics(prefill), "decode": _metrics(decode)}
    return tokens, cached, lambda pod, name, **labels: _grew(before[pod], after[pod], name, **labels)


def test_a_direct_push_serves_the_decode_pod_from_its_inbox(sim_pods, tiny_llama):
    prefill, decode, *_ = sim_pods
    prompt = list(range(1000, 1100))  # six full blocks
    tokens, cached, grew = _measured_pd(prefill, decode, prompt, 6, target=decode.addresses[0])
    assert tokens == simulated_output(prompt, 6, 8192, load_eos_token_ids(tiny_llama))
    assert cached == 6 * BLOCK
    assert grew("decode", "tessera_kv_store_hits_total", tier="inbox") == 6
    assert grew("decode", "tessera_kv_store_hits_total", tier="redis") == 0
    assert grew("prefill", "tessera_kv_transfer_push_paths_total", path="grpc") == 1
    assert grew("decode", "tessera_kv_store_inbox_received_bytes_total") == 6 * SIM_VALUE_BYTES
    assert grew("prefill", "tessera_kv_transfer_pushes_total", outcome="ok") == 1
    assert grew("prefill", "tessera_kv_transfer_bytes_total", channel="direct") == 6 * SIM_VALUE_BYTES
    # Not through Redis synchronously: nothing counted on the Redis channel.
    assert grew("prefill", "tessera_kv_transfer_bytes_total", channel="redis") == 0


def test_a_prefix_cached_on_the_prefill_pod_is_pushed_too(sim_pods, tiny_llama):
    """The second prompt's first four blocks are cached on the prefill pod
    (not computed there this time, so never saved): its push still carries
    them, all six full blocks."""
    prefill, decode, *_ = sim_pods
    shared = list(range(2000, 2064))
    first, second = shared + list(range(3000, 3040)), shared + list(range(4000, 4040))
    _pd(prefill.addresses[0], decode.addresses[0], first, 2, target=decode.addresses[0])
    tokens, cached, grew = _measured_pd(prefill, decode, second, 3, target=decode.addresses[0])
    assert tokens == simulated_output(second, 3, 8192, load_eos_token_ids(tiny_llama))
    assert cached == 6 * BLOCK
    assert grew("decode", "tessera_kv_store_inbox_received_bytes_total") == 6 * SIM_VALUE_BYTES
    assert grew("prefill", "tessera_kv_transfer_bytes_total", channel="direct") == 6 * SIM_VALUE_BYTES


def test_a_push_to_a_pod_without_an_inbox_falls_back_to_redis(sim_pods, tiny_llama):
    prefill, _, closed, _ = sim_pods
    prompt = list(range(5000, 5090))  # five full blocks
    tokens, cached, grew = _measured_pd(prefill, closed, prompt, 4, target=closed.addresses[0])
    assert tokens == simulated_output(prompt, 4, 8192, load_eos_token_ids(tiny_llama))
    assert cached == 5 * BLOCK
    assert grew("prefill", "tessera_kv_transfer_pushes_total", outcome="fallback") == 1
    assert grew("prefill", "tessera_kv_transfer_bytes_total", channel="redis") == 5 * SIM_VALUE_BYTES
    assert grew("decode", "tessera_kv_store_hits_total", tier="redis") == 5


def test_a_push_to_an_address_nobody_serves_falls_back_to_redis(sim_pods, tiny_llama, redis):
    prefill, decode, *_ = sim_pods
    prompt = list(range(6000, 6070))  # four full blocks
    before = _metrics(prefill)
    _pd(prefill.addresses[0], decode.addresses[0], prompt, 3, target=f"127.0.0.1:{free_port()}")
    assert _grew(before, _metrics(prefill), "tessera_kv_transfer_pushes_total", outcome="fallback") == 1
    # Every block is in Redis, so any decode pod finds it there.
    for block_hash in hash_request_tokens(prompt, BLOCK)[:4]:
        assert any(k.endswith(block_hash.hex().encode()) for k in redis.client.keys("tessera:*"))


_DYING_DECODE_POD = textwrap.dedent('''
    import os, sys
    from concurrent import futures
    import grpc
    from tessera.v1 import engine_pb2_grpc as pb_grpc

    class Dying(pb_grpc.EngineServicer):
        def PushKVBlocks(self, request_iterator, context):
            next(request_iterator)  # the first message arrives, then the pod dies
            print("got one", flush=True)
            os._exit(9)

    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", 64 << 20)])
    pb_grpc.add_EngineServicer_to_server(Dying(), server)
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    server.start()
    print("serving", flush=True)
    server.wait_for_termination()
''')


def test_a_decode_pod_killed_mid_push_leaves_the_blocks_in_redis(sim_pods, tiny_llama, redis):
    """The receiving process dies after the push's first message: the
    prefill request still answers (no hang), its blocks fall back to Redis,
    and a decode pod reading them there gives the right tokens."""
    prefill, decode, *_ = sim_pods
    port = free_port()
    dying = subprocess.Popen([sys.executable, "-c", _DYING_DECODE_POD, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert dying.stdout.readline().strip() == "serving"
        prompt = list(range(7000, 7300))  # 18 full blocks
        before = _metrics(prefill)
        start = time.monotonic()
        asyncio.run(_produce(prefill.addresses[0], prompt, f"127.0.0.1:{port}"))
        assert time.monotonic() - start < 10
        assert dying.wait(timeout=10) == 9  # it did die mid-push
        assert _grew(before, _metrics(prefill), "tessera_kv_transfer_pushes_total", outcome="fallback") == 1
        tokens, cached = asyncio.run(_consume(decode.addresses[0], prompt, 4))
        assert tokens == simulated_output(prompt, 4, 8192, load_eos_token_ids(tiny_llama))
        assert cached == 18 * BLOCK
    finally:
        dying.kill()
        dying.wait()


def _call(address: str, method: str, request, authenticated: bool = True):
    """One Engine call, with the internal token or without."""
    channel = pod_channel(address) if authenticated else grpc.insecure_channel(address)
    with channel:
        return getattr(pb_grpc.EngineStub(channel), method)(request, timeout=10)


def _push(address: str, blocks: list[tuple[bytes, bytes]], authenticated: bool = True) -> pb.PushKVBlocksReply:
    messages = iter([pb.PushKVBlocksRequest(transfer_id="t", blocks=[pb.KVBlock(block_hash=h, value=v)
                                                                      for h, v in blocks])])
    return _call(address, "PushKVBlocks", messages, authenticated)


def test_pushes_are_refused_without_the_token_or_in_a_wrong_shape(sim_pods):
    prefill, decode, closed, _ = sim_pods
    block_hash, value = b"\x01" * 32, b"\x00" * SIM_VALUE_BYTES
    with pytest.raises(grpc.RpcError) as e:
        _push(decode.addresses[0], [(block_hash, value)], authenticated=False)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for bad, what in (((block_hash, value[:-1]), "bytes"), ((b"\x01" * 31, value), "hash")):
        with pytest.raises(grpc.RpcError) as e:
            _push(decode.addresses[0], [bad])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.details()
    for pods in (prefill, closed):
        with pytest.raises(grpc.RpcError) as e:
            _push(pods.addresses[0], [(block_hash, value)])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_decode_pod_with_an_inbox_socket_takes_the_push_there(sim_pods, tiny_llama):
    prefill, *_, socket_pod = sim_pods
    prompt = list(range(3000, 3100))  # six full blocks
    tokens, cached, grew = _measured_pd(prefill, socket_pod, prompt, 6, target=socket_pod.addresses[0])
    assert tokens == simulated_output(prompt, 6, 8192, load_eos_token_ids(tiny_llama))
    assert cached == 6 * BLOCK
    assert grew("decode", "tessera_kv_store_hits_total", tier="inbox") == 6
    assert grew("prefill", "tessera_kv_transfer_push_paths_total", path="socket") == 1
    assert grew("prefill", "tessera_kv_transfer_push_paths_total", path="grpc") == 0
    assert grew("decode", "tessera_kv_store_inbox_received_bytes_total") == 6 * SIM_VALUE_BYTES


def _open_inbox(address: str, authenticated: bool = True) -> pb.OpenKVInboxReply:
    return _call(address, "OpenKVInbox", pb.OpenKVInboxRequest(transfer_id="t"), authenticated)


def test_an_inbox_ticket_is_for_authenticated_callers_of_a_pod_with_an_inbox(sim_pods):
    from kv_store.inbox_socket import InboxRefused, push_blocks

    prefill, decode, closed, socket_pod = sim_pods
    with pytest.raises(grpc.RpcError) as e:
        _open_inbox(socket_pod.addresses[0], authenticated=False)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for pods in (prefill, closed):
        with pytest.raises(grpc.RpcError) as e:
            _open_inbox(pods.addresses[0])
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _open_inbox(decode.addresses[0]).port == 0  # an inbox, no socket: push over gRPC
    opened = _open_inbox(socket_pod.addresses[0])
    assert opened.port > 0 and len(opened.ticket) == 32 and opened.expires_in_ms > 0
    block = (b"\x02" * 32, b"\x00" * SIM_VALUE_BYTES)
    # The port alone lets nobody in: a made-up ticket is refused, the issued one works once.
    with pytest.raises(InboxRefused, match="ticket"):
        push_blocks("127.0.0.1", opened.port, b"\x00" * 32, [block], timeout_s=10)
    assert push_blocks("127.0.0.1", opened.port, opened.ticket, [block], timeout_s=10) == 1
    with pytest.raises(InboxRefused, match="ticket"):
        push_blocks("127.0.0.1", opened.port, opened.ticket, [block], timeout_s=10)


def test_forged_pushes_are_refused_on_read_and_the_prompt_recomputed(sim_pods, tiny_llama, redis):
    """A holder of the token who lacks the MAC key pushes values under a
    prompt's first block: bytes that are no block at all, and a real block's
    value with one payload byte changed. The decode pod refuses each when it
    reads it (and deletes it) and computes the prompt; nothing it serves is
    the forgery."""
    prefill, decode, *_ = sim_pods
    for i, (forge, reason) in enumerate(((lambda value: b"\x07" * len(value), "format"),
                                         (lambda value: value[:-1] + bytes([value[-1] ^ 1]), "mac"))):
        prompt = list(range(8000 + 100 * i, 8050 + 100 * i))  # three full blocks
        # Real signed values, in Redis: a push to nowhere falls back there.
        asyncio.run(_produce(prefill.addresses[0], prompt, f"127.0.0.1:{free_port()}"))
        first_hash = hash_request_tokens(prompt, BLOCK)[0]
        key = next(k for k in redis.client.keys("tessera:*") if k.endswith(first_hash.hex().encode()))
        assert _push(decode.addresses[0], [(first_hash, forge(redis.client.get(key)))]).num_blocks == 1
        before = _metrics(decode)
        tokens, cached = asyncio.run(_consume(decode.addresses[0], prompt, 4))
        after = _metrics(decode)
        assert tokens == simulated_output(prompt, 4, 8192, load_eos_token_ids(tiny_llama))
        assert cached == 0  # the run stops at the refused first block: Redis's good copy is not reached
        assert _grew(before, after, "tessera_kv_store_rejected_values_total", tier="inbox", reason=reason) == 1


def test_a_target_on_a_request_that_does_not_produce_is_refused(sim_pods):
    _, decode, *_ = sim_pods

    async def run(mode, target):
        async with pod_aio_channel(decode.addresses[0]) as channel:
            request = greedy([5, 6, 7], 2)
            request.kv_transfer.mode = mode
            request.kv_transfer.direct_target = target
            return [r async for r in pb_grpc.EngineStub(channel).Generate(request, timeout=10)]

    for target in ("127.0.0.1:5000", "not an address", "host:99999"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(run(pb.KVTransferParams.MODE_CONSUME, target))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "direct_target" in e.value.details()


def test_a_prefill_pod_killed_mid_push_leaves_a_sound_partial_run(sim_pods, tiny_llama, fast_sim_profile, redis,
                                                                  tmp_path):
    """The sending process dies while its push is under way (one block per
    step, so the push spans the prefill): the decode pod keeps the leading
    blocks it took, each verified when read, computes the rest, and gives
    the right tokens; it keeps taking pushes afterwards."""
    _, decode, *_ = sim_pods
    args = SIM_ARGS + ["--kv-redis-url", redis.url, "--role", "prefill", "--max-num-batched-tokens", "16"]
    prompt = list(range(7500, 7900))  # 24 full blocks, one per step of ~12 ms
    before = _metrics(decode)
    received = 0
    with SimulatedPodsProcess(tiny_llama, fast_sim_profile, 1, args, log_path=tmp_path / "prefill.log") as dying:
        dying.wait_serving()

        async def produce_and_kill():
            task = asyncio.create_task(_produce(dying.addresses[0], prompt, decode.addresses[0]))
            nonlocal received
            deadline = time.monotonic() + 10
            while received == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
                received = _grew(before, _metrics(decode), "tessera_kv_store_inbox_received_bytes_total")
            dying.proc.kill()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await task
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        asyncio.run(produce_and_kill())
    blocks = int(received // SIM_VALUE_BYTES)
    assert 0 < blocks < 24, "the pod must die mid-push"
    tokens, cached = asyncio.run(_consume(decode.addresses[0], prompt, 4, mode=pb.KVTransferParams.MODE_NONE))
    assert tokens == simulated_output(prompt, 4, 8192, load_eos_token_ids(tiny_llama))
    # What arrived before the kill is used (verified); the rest is computed here.
    taken = _grew(before, _metrics(decode), "tessera_kv_store_inbox_received_bytes_total") // SIM_VALUE_BYTES
    assert cached == taken * BLOCK and taken < 24
    other = list(range(7950, 8000))
    assert _pd(sim_pods[0].addresses[0], decode.addresses[0], other, 2, target=decode.addresses[0])[1] == 3 * BLOCK


def test_with_redis_down_pd_still_answers_right_direct_from_the_inbox(tiny_llama, fast_sim_profile, tmp_path):
    """Redis killed under running pods: a direct push still serves the decode
    pod from its inbox; P/D over Redis gives the right tokens too (the
    decode pod computes the prompt); no request hangs."""
    from kv_store.local_redis import RedisServer

    redis = RedisServer(tmp_path)
    store = ["--kv-redis-url", redis.url]
    try:
        with SimulatedPodsProcess(tiny_llama, fast_sim_profile, 1, SIM_ARGS + store + ["--role", "prefill"],
                                  log_path=tmp_path / "prefill.log") as prefill, \
             SimulatedPodsProcess(tiny_llama, fast_sim_profile, 1, SIM_ARGS + store + ["--role", "decode", *INBOX],
                                  log_path=tmp_path / "decode.log") as decode:
            prefill.wait_serving()
            decode.wait_serving()
            redis.stop()
            for i, target in enumerate((decode.addresses[0], "")):
                prompt = list(range(6500 + 200 * i, 6590 + 200 * i))  # five full blocks
                start = time.monotonic()
                tokens, cached = _pd(prefill.addresses[0], decode.addresses[0], prompt, 4, target=target)
                assert time.monotonic() - start < 20
                assert tokens == simulated_output(prompt, 4, 8192, load_eos_token_ids(tiny_llama))
                assert cached == (5 * BLOCK if target else 0)
    finally:
        redis.stop()


def test_under_mutual_tls_a_prefill_pod_pushes_with_its_own_certificate(tiny_llama, tmp_path):
    """Pods that demand client certificates: the prefill pod dials the decode
    pod with its own (the operator mounts one certificate for serving and
    dialling) and checks the decode pod's against --tls-server-name; without
    that name the handshake fails (pods are dialled by IP) and the push
    falls back to Redis."""
    from kv_store.local_redis import RedisServer
    from tessera.internal_channel import InternalClient, InternalTLS
    from tessera.internal_secret import InternalSecret
    from tests.gateway.conftest import POD_ARGS
    from tests.tls_certs import write_test_certs

    server_name = "engine.tessera.internal"
    certs = write_test_certs(tmp_path, server_name)
    tls = ["--tls-cert-file", certs["server.crt"], "--tls-key-file", certs["server.key"],
           "--tls-client-ca-file", certs["ca.crt"]]
    client = InternalClient(InternalSecret.require("tests"),
                            InternalTLS(certs["ca.crt"], certs["client.crt"], certs["client.key"], server_name))
    redis = RedisServer(tmp_path)
    store = ["--kv-redis-url", redis.url]

    def pod(name, args):
        return EnginePodProcess(tiny_llama, [*POD_ARGS, *store, *tls, *args], log_path=tmp_path / f"{name}.log",
                                health_port=True)

    async def pd(prefill, decode, prompt):
        async with client.aio_channel(prefill.address) as pch, client.aio_channel(decode.address) as dch:
            produce = greedy(prompt, 2)
            produce.kv_transfer.mode = pb.KVTransferParams.MODE_PRODUCE
            produce.kv_transfer.direct_target = decode.address
            async for _ in pb_grpc.EngineStub(pch).Generate(produce, timeout=60):
                pass
            consume = greedy(prompt, 2)
            consume.kv_transfer.mode = pb.KVTransferParams.MODE_CONSUME
            return max([r.num_cached_tokens async for r in pb_grpc.EngineStub(dch).Generate(consume, timeout=60)])

    try:
        with pod("named", ["--role", "prefill", "--tls-server-name", server_name]) as named, \
             pod("unnamed", ["--role", "prefill"]) as unnamed, \
             pod("decode", ["--role", "decode", *INBOX, "--kv-inbox-port", str(free_port())]) as decode:
            for p in (named, unnamed, decode):
                p.wait_serving()
            for i, (prefill, outcome) in enumerate(((named, "ok"), (unnamed, "fallback"))):
                before = scrape_metrics(prefill)
                assert asyncio.run(pd(prefill, decode, list(range(100 + 100 * i, 170 + 100 * i)))) == 4 * BLOCK
                after = scrape_metrics(prefill)
                assert _grew(before, after, "tessera_kv_transfer_pushes_total", outcome=outcome) == 1
                # The named pod's push went over the inbox socket, under the same mutual TLS.
                assert _grew(before, after, "tessera_kv_transfer_push_paths_total", path="socket") == (i == 0)
    finally:
        redis.stop()
