"""Client helpers over the generated stubs."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from tessera.internal_channel import InternalClient
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc


def pod_aio_channel(address: str) -> grpc.aio.Channel:
    """An asyncio channel to an engine pod, with the test secret's token on every call."""
    return InternalClient.from_env().aio_channel(address)


def pod_channel(address: str) -> grpc.Channel:
    """A blocking channel to an engine pod, with the test secret's token on every call."""
    return InternalClient.from_env().channel(address)


def greedy(prompt: list[int], max_tokens: int, request_id: str = "", **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=pb.SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **params}),
    )


async def collect(stub: pb_grpc.EngineStub, request: pb.GenerateRequest, metadata=()) -> tuple[list[int], str]:
    tokens, reason = [], ""
    async for resp in stub.Generate(request, metadata=metadata):
        tokens.extend(resp.token_ids)
        reason = resp.finish_reason or reason
    return tokens, reason


async def generate_all(address: str, requests: list[pb.GenerateRequest]) -> list[tuple[list[int], str]]:
    async with pod_aio_channel(address) as ch:
        stub = pb_grpc.EngineStub(ch)
        return await asyncio.gather(*(collect(stub, r) for r in requests))


def load(address: str, block_hashes: list[bytes] = ()) -> pb.LoadReport:
    with pod_channel(address) as ch:
        return pb_grpc.EngineStub(ch).GetLoad(pb.LoadRequest(block_hashes=list(block_hashes)), timeout=5)


def scrape_metrics(pod) -> dict[tuple[str, tuple], float]:
    """The pod's Prometheus samples: (name, sorted labels but model_name) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples
