"""Send a run's requests through the gateways: open loop at the trace's
arrival times, streamed (serve's ServeClient, so TTFT and ITL are measured
as `tessera bench serve` measures them), token-id prompts on
/v1/completions.

- Each tenant sends with its own API key (one HTTP session per tenant).
- With several gateway replicas the requests alternate between them in
  arrival order, so the turns of one conversation land on different
  replicas: the replicas share nothing, so they must agree on where a
  prefix lives by asking the pods (or by hashing), never by memory.
- A conversation's next turn waits for its previous turn to end (a user
  reads the reply before typing): it is sent at its arrival time or when
  the previous turn ended, whichever is later. The delay is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from tqdm import tqdm

from tessera_tools.bench.fleet.workload import FleetRequest
from tessera_tools.bench.serve.client import ServeClient, Target
from tessera_tools.bench.serve.dataset import ServeRequest
from tessera_tools.bench.serve.stream import RequestOutcome


@dataclass
class ReplayResult:
    outcomes: list[RequestOutcome]
    """In request order."""
    send_delays_s: list[float]
    """Per request: seconds it was sent after its arrival time (its previous turn had not ended, or the client
    fell behind)."""
    duration_s: float
    """The run's start -> the last request ended."""


def _serve_request(request: FleetRequest) -> ServeRequest:
    # Target.body puts `prompt` in the JSON as it is: a list of ids is a token-id prompt.
    return ServeRequest(output_len=request.output_len, prompt=request.prompt_token_ids,  # type: ignore[arg-type]
                        prompt_len=len(request.prompt_token_ids))


async def replay(requests: list[FleetRequest], gateway_urls: list[str], api_keys: list[str], model: str,
                 request_timeout_s: float, bar: tqdm) -> ReplayResult:
    targets = [Target(url + "/v1", "completions", model) for url in gateway_urls]
    ended = [asyncio.Event() for _ in requests]
    failed = 0
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for tenant in sorted({r.tenant for r in requests}):
            client = ServeClient(targets[0].base_url, api_keys[tenant], request_timeout_s)
            clients[tenant] = await stack.enter_async_context(client)
        start = time.perf_counter()

        async def one(index: int, request: FleetRequest) -> tuple[RequestOutcome, float]:
            nonlocal failed
            await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
            if request.after is not None:
                await ended[request.after].wait()
            delay = time.perf_counter() - start - request.arrival_s
            try:
                outcome = await clients[request.tenant].send(targets[index % len(targets)], _serve_request(request))
            finally:
                ended[index].set()
            failed += not outcome.ok
            bar.update(1)
            if failed:
                bar.set_postfix(failed=failed, refresh=False)
            return outcome, delay

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - start
    return ReplayResult([o for o, _ in results], [max(0.0, d) for _, d in results], duration)
