"""The engine pod over gRPC: outputs equal the offline engine's, cancellation
frees KV, many concurrent streams, bad input, prefix residency."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from engine_pod import LLM, SamplingParams
from kv_store.block_hash import hash_request_tokens
from tessera.internal_channel import InternalClient
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.engine_pod.server.client import (
    collect,
    generate_all,
    greedy,
    load,
    pod_aio_channel,
    pod_channel,
    scrape_metrics,
)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama), dtype="float64", max_model_len=256, kv_cache_memory_bytes=32 << 20)


def _offline_tokens(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _prompts(n, seed, max_len=60):
    rng = random.Random(seed)
    return [[rng.randrange(5, 6000) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


def test_three_concurrent_streams_match_offline(pod, offline):
    prompts = _prompts(3, seed=1)
    max_tokens = [24, 17, 31]
    got = asyncio.run(generate_all(pod.address, [greedy(p, n) for p, n in zip(prompts, max_tokens)]))
    assert got == _offline_tokens(offline, prompts, max_tokens)


def test_two_hundred_concurrent_streams(pod, offline):
    prompts = _prompts(200, seed=2)
    rng = random.Random(3)
    max_tokens = [rng.randint(1, 16) for _ in prompts]
    got = asyncio.run(generate_all(pod.address, [greedy(p, n) for p, n in zip(prompts, max_tokens)]))
    assert got == _offline_tokens(offline, prompts, max_tokens)
    report = load(pod.address)
    assert report.num_running == 0 and report.num_waiting == 0
    assert report.num_free_kv_blocks == report.num_kv_blocks


def test_cancelled_stream_frees_its_blocks(pod):

    aborted = ("tessera_request_success_total", (("finished_reason", "abort"),))
    before = scrape_metrics(pod)

    async def run():
        async with pod_aio_channel(pod.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            call = stub.Generate(greedy(_prompts(1, seed=4, max_len=100)[0], 200, ignore_eos=True))
            received = 0
            async for resp in call:
                received += len(resp.token_ids)
                if received >= 3:
                    break
            assert load(pod.address).num_running == 1
            call.cancel()
            # A generous deadline: a loaded 2-core CI machine can delay the
            # pod's threads. The finish reason below, not the time, tells a
            # cancelled request from one that ran to its 200 tokens.
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                report = load(pod.address)
                if report.num_running == 0 and report.num_free_kv_blocks == report.num_kv_blocks:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"request still held 10 s after cancel: {report}")

    asyncio.run(run())
    assert scrape_metrics(pod).get(aborted, 0.0) - before.get(aborted, 0.0) == 1


def test_cancellations_log_no_error(pod):
    """A client going away is routine: no ERROR and no traceback in the pod's
    log, however the stream ends (a cancelled task, a deadline, a closed
    channel), each while the pod is streaming tokens. A plain channel with
    the token as call metadata: the interceptor of pod_aio_channel reads the
    stream through a task of its own, and its cancel reaches the pod at
    another point."""
    start = pod.log_path.stat().st_size
    metadata = InternalClient.from_env().secret.metadata()

    async def consume(stub, **kwargs):
        async for _ in stub.Generate(greedy([11] * 30, 200, ignore_eos=True), metadata=metadata, **kwargs):
            pass

    async def until_running(n: int):
        deadline = time.monotonic() + 10.0
        while load(pod.address).num_running != n:
            assert time.monotonic() < deadline, f"num_running never reached {n}"
            await asyncio.sleep(0.02)

    async def run():
        async with grpc.aio.insecure_channel(pod.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            task = asyncio.create_task(consume(stub))
            await until_running(1)
            await asyncio.sleep(0.1)  # tokens are flowing
            task.cancel()
            await until_running(0)
            with pytest.raises(grpc.aio.AioRpcError):
                # A deadline mid-stream: 200 tokens take well over 0.2 s (a fast host streamed all
                # of them within 0.5 s once, and the call ended without an error).
                await consume(stub, timeout=0.2)
            await until_running(0)
        channel = grpc.aio.insecure_channel(pod.address)
        task = asyncio.create_task(consume(pb_grpc.EngineStub(channel)))
        await until_running(1)
        await asyncio.sleep(0.1)
        await channel.close()
        await asyncio.gather(task, return_exceptions=True)
        await until_running(0)

    asyncio.run(run())
    time.sleep(0.5)  # a closed stream's generator is finalized after the abort
    with open(pod.log_path) as f:
        f.seek(start)
        log = f.read()
    assert "ERROR" not in log and "Traceback" not in log, log


def test_abort_rpc_ends_the_stream(pod):
    async def run():
        async with pod_aio_channel(pod.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            call = stub.Generate(greedy([7] * 20, 200, request_id="to-abort", ignore_eos=True))
            first = await call.read()
            assert first.token_ids
            aborted = await stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"]))
            assert list(aborted.aborted) == ["to-abort"]
            reasons = []
            while (resp := await call.read()) is not grpc.aio.EOF:
                reasons.append(resp.finish_reason)
            assert reasons[-1] == "abort"

    asyncio.run(run())


BAD_REQUESTS = {
    "temperature": greedy([5, 6], 4, temperature=-1.0),
    "top_p": greedy([5, 6], 4, top_p=1.5),
    "top_k": greedy([5, 6], 4, top_k=-3),
    "min_p": greedy([5, 6], 4, min_p=2.0),
    "presence_penalty": greedy([5, 6], 4, presence_penalty=3.0),
    "repetition_penalty": greedy([5, 6], 4, repetition_penalty=-1.0),
    "max_tokens": greedy([5, 6], -1),
    "min_tokens": greedy([5, 6], 4, min_tokens=9),
    "logprobs": greedy([5, 6], 4, logprobs=99),
    "stop_token_ids": greedy([5, 6], 4, stop_token_ids=[10**6]),
    "prompt": greedy([], 4),
    "prompt_token_ids": greedy([5, 8192], 4),
    "max_model_len": greedy([5] * 300, 4),
    "kv_transfer.mode": pb.GenerateRequest(prompt_token_ids=[5], kv_transfer=pb.KVTransferParams(mode=7)),
}


@pytest.mark.parametrize("field", sorted(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field(pod, field):
    with pod_channel(pod.address) as channel:
        stub = pb_grpc.EngineStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(BAD_REQUESTS[field], timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()
        # The pod carries on.
        tokens = [t for r in stub.Generate(greedy([5, 6, 7], 3), timeout=10) for t in r.token_ids]
        assert len(tokens) == 3


def test_kv_transfer_without_a_store_is_failed_precondition(pod):
    request = greedy([5, 6], 2)
    request.kv_transfer.mode = pb.KVTransferParams.MODE_CONSUME
    with pod_channel(pod.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.EngineStub(channel).Generate(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_duplicate_request_id_in_flight(pod):
    async def run():
        async with pod_aio_channel(pod.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            call = stub.Generate(greedy([9] * 10, 100, request_id="dup", ignore_eos=True))
            await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, greedy([9], 2, request_id="dup"))
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            call.cancel()

    asyncio.run(run())


def test_load_reports_prefix_residency(pod):
    prompt = _prompts(1, seed=5, max_len=10)[0] + list(range(100, 164))
    hashes = hash_request_tokens(prompt, 16)
    assert load(pod.address, hashes).matched_prefix_blocks == 0
    asyncio.run(generate_all(pod.address, [greedy(prompt, 2)]))
    report = load(pod.address, hashes)
    assert report.matched_prefix_blocks == len(hashes) >= 4
    salted = hash_request_tokens(prompt, 16, cache_salt="other-tenant")
    assert load(pod.address, salted).matched_prefix_blocks == 0
    assert report.block_size == 16 and report.role == "mixed" and report.serving


def test_stream_load_pushes_reports(pod):
    async def run():
        async with pod_aio_channel(pod.address) as channel:
            call = pb_grpc.EngineStub(channel).StreamLoad(pb.LoadRequest(interval_ms=50))
            reports = []
            async for report in call:
                reports.append(report)
                if len(reports) == 3:
                    break
            call.cancel()
            return reports

    reports = asyncio.run(run())
    assert len(reports) == 3 and all(r.num_kv_blocks > 0 for r in reports)


def test_stream_load_rejects_a_negative_interval(pod):
    with pod_channel(pod.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            next(iter(pb_grpc.EngineStub(channel).StreamLoad(pb.LoadRequest(interval_ms=-5), timeout=5)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "interval_ms" in info.value.details()
