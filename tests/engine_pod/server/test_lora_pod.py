"""An engine pod serving LoRA adapters by name: Generate on an adapter streams
the offline engine's tokens for it; the load reports list the adapters with
their fingerprints; adapters load and unload at run time, from the pod's
--lora-root folders only, and every refusal is a gRPC status with a message."""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest

from engine_pod import LLM, LoRARequest, SamplingParams
from engine_pod.server.process import EnginePodProcess
from tests.engine_pod.server.client import generate_all, greedy, load, pod_channel, scrape_metrics
from tests.engine_pod.server.conftest import POD_ARGS
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc

PROMPTS = [[5, 17, 300, 42, 99, 7] * 3, [11, 12, 13, 14, 15]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def lora_root(tiny_llama_loras, tmp_path_factory):
    """A --lora-root holding copies of adapters 1 and 2 (adapter 0 is served from the flags)."""
    root = tmp_path_factory.mktemp("lora-root")
    for i in (1, 2):
        shutil.copytree(tiny_llama_loras[i], root / f"adapter-{i}")
    return root


@pytest.fixture(scope="module")
def lora_pod(tiny_llama, tiny_llama_loras, lora_root, tmp_path_factory):
    args = [*POD_ARGS, "--cpu-threads", "1", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
            "--lora-modules", f"a0={tiny_llama_loras[0]}", "--lora-root", str(lora_root)]
    with EnginePodProcess(tiny_llama, args, log_path=tmp_path_factory.mktemp("pod") / "pod.log") as pod:
        pod.wait_serving()
        yield pod


def offline(tiny_llama, path: str | None) -> list[list[int]]:
    with LLM(str(tiny_llama), dtype="float64", max_model_len=256, kv_cache_memory_bytes=32 << 20,
             enable_lora=True, max_lora_rank=16) as llm:
        lora = None if path is None else LoRARequest("x", 1, path)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


def generate(pod, lora_name: str) -> list[list[int]]:
    requests = [greedy(p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
    for r in requests:
        r.lora_name = lora_name
    return [tokens for tokens, _ in asyncio.run(generate_all(pod.address, requests))]


def stub_call(pod, method: str, request):
    with pod_channel(pod.address) as channel:
        return getattr(pb_grpc.EngineStub(channel), method)(request, timeout=30)


def test_generate_on_an_adapter_and_on_the_base(lora_pod, tiny_llama, tiny_llama_loras):
    on_adapter = generate(lora_pod, "a0")
    assert on_adapter == offline(tiny_llama, str(tiny_llama_loras[0]))
    assert generate(lora_pod, "") == offline(tiny_llama, None) != on_adapter
    (adapter,) = load(lora_pod.address).lora_adapters
    assert adapter.name == "a0" and adapter.resident and len(adapter.fingerprint) == 64
    metrics = scrape_metrics(lora_pod)
    a0 = (("lora_name", "a0"),)
    assert metrics[("tessera_lora_requests_total", a0)] == len(PROMPTS)
    assert metrics[("tessera_lora_generation_tokens_total", a0)] == len(PROMPTS) * MAX_TOKENS
    assert metrics[("tessera_lora_adapter_resident", a0)] == 1.0
    assert 0 < metrics[("tessera_lora_load_seconds", a0)] < 30


def test_an_unknown_adapter_is_not_found(lora_pod):
    with pytest.raises(grpc.RpcError) as e:
        generate(lora_pod, "nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope' is not served" in e.value.details()


def test_load_and_unload_at_run_time(lora_pod, lora_root, tiny_llama):
    path = str(lora_root / "adapter-2")
    names = [a.name for a in stub_call(lora_pod, "LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(
        lora_name="a2", lora_path=path)).adapters]
    assert names == ["a0", "a2"]
    assert generate(lora_pod, "a2") == offline(tiny_llama, path)
    assert [a.name for a in stub_call(lora_pod, "UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(
        lora_name="a2")).adapters] == ["a0"]
    with pytest.raises(grpc.RpcError) as e:
        generate(lora_pod, "a2")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("name", "where", "code", "message"), [
    ("outside", "flags-adapter", grpc.StatusCode.PERMISSION_DENIED, "outside this pod's --lora-root"),
    ("escape", "../", grpc.StatusCode.PERMISSION_DENIED, "outside this pod's --lora-root"),
    ("a0", "adapter-1", grpc.StatusCode.ALREADY_EXISTS, "already served from another folder"),
    ("missing", "no-such-adapter", grpc.StatusCode.INVALID_ARGUMENT, "no such adapter folder"),
    ("bad name!", "adapter-1", grpc.StatusCode.INVALID_ARGUMENT, "not a valid adapter name"),
])
def test_refused_loads(lora_pod, lora_root, tiny_llama_loras, name, where, code, message):
    path = str(tiny_llama_loras[0]) if where == "flags-adapter" else str(lora_root / where)
    with pytest.raises(grpc.RpcError) as e:
        stub_call(lora_pod, "LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path))
    assert e.value.code() == code and message in e.value.details()


def test_unloading_an_unknown_adapter(lora_pod):
    with pytest.raises(grpc.RpcError) as e:
        stub_call(lora_pod, "UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(lora_name="never-loaded"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_pod_without_enable_lora(pod, tiny_llama_loras):
    """The shared plain pod (tests/engine_pod/server/conftest.py)."""
    with pytest.raises(grpc.RpcError) as e:
        stub_call(pod, "LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_name="a", lora_path=str(tiny_llama_loras[0])))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not load(pod.address).lora_adapters


def test_prefill_and_decode_pods_on_an_adapter(tiny_llama, tiny_llama_loras, redis_server, tmp_path):
    """P/D on an adapter: the prefill pod computes the prompt's KV with the adapter and the decode
    pod reads it from Redis under the adapter's own block hashes; the tokens are the offline
    engine's on that adapter. The same prompt on the base model then finds no block there."""
    import random

    from tests.engine_pod.server.client import collect, pod_aio_channel

    prompt = [random.Random(5).randrange(5, 6000) for _ in range(100)]
    lora_args = ["--cpu-threads", "1", "--enable-lora", "--max-lora-rank", "16",
                 "--lora-modules", f"a0={tiny_llama_loras[0]}", "--kv-redis-url", redis_server.url]
    with LLM(str(tiny_llama), dtype="float64", max_model_len=256, kv_cache_memory_bytes=32 << 20,
             enable_lora=True, max_lora_rank=16) as llm:
        want = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8),
                            lora_request=LoRARequest("a0", 1, str(tiny_llama_loras[0])))[0].outputs[0].token_ids
    with EnginePodProcess(tiny_llama, [*POD_ARGS, *lora_args, "--role", "prefill"],
                          log_path=tmp_path / "p.log") as prefill, \
         EnginePodProcess(tiny_llama, [*POD_ARGS, *lora_args, "--role", "decode"],
                          log_path=tmp_path / "d.log") as decode:
        prefill.wait_serving()
        decode.wait_serving()

        async def run(lora_name: str):
            async with pod_aio_channel(prefill.address) as pch, pod_aio_channel(decode.address) as dch:
                produce, consume = greedy(prompt, 8), greedy(prompt, 8)
                for request in (produce, consume):
                    request.lora_name = lora_name
                produce.kv_transfer.mode = pb.KVTransferParams.MODE_PRODUCE
                consume.kv_transfer.mode = pb.KVTransferParams.MODE_CONSUME
                first, _ = await collect(pb_grpc.EngineStub(pch), produce) if lora_name else ([], "")
                tokens, cached = [], 0
                async for resp in pb_grpc.EngineStub(dch).Generate(consume):
                    tokens += resp.token_ids
                    cached = max(cached, resp.num_cached_tokens)
                return first, tokens, cached

        first, tokens, cached = asyncio.run(run("a0"))
        assert tokens == want and first == want[:1]
        assert cached == 96  # every full block of the prompt came from Redis
        _, _, base_cached = asyncio.run(run(""))
        assert base_cached == 0
