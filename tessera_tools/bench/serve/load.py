"""Open-loop load at one request rate: each request is sent at its arrival
time whether or not earlier ones have finished, at most `max_concurrency`
in flight (later arrivals wait for a slot, and their clock starts when they
are sent, as in `vllm bench serve`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tqdm import tqdm

from tessera_tools.bench.serve.client import ServeClient, Target
from tessera_tools.bench.serve.dataset import ServeRequest
from tessera_tools.bench.serve.stream import RequestOutcome


@dataclass
class RateRun:
    """The outcomes of one rate's requests, in dataset order, and the run's
    duration: first arrival -> last request ended."""

    request_rate: float
    outcomes: list[RequestOutcome]
    duration_s: float


async def run_at_rate(client: ServeClient, target: Target, requests: list[ServeRequest], offsets: list[float],
                      request_rate: float, max_concurrency: int | None, progress: bool = True) -> RateRun:
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=f"rate {request_rate:g}/s", unit="req", disable=not progress)
    start = time.perf_counter()

    async def one(request: ServeRequest, offset: float) -> RequestOutcome:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if slots is None:
            outcome = await client.send(target, request)
        else:
            async with slots:
                outcome = await client.send(target, request)
        bar.update(1)
        return outcome

    try:
        outcomes = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets)))
    finally:
        bar.close()
    return RateRun(request_rate, list(outcomes), time.perf_counter() - start)
