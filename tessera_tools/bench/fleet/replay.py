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

from dataclasses import dataclass

from tqdm import tqdm

from tessera_tools.bench.fleet.scenario_replay import replay_traced
from tessera_tools.bench.fleet.workload import FleetRequest
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


async def replay(requests: list[FleetRequest], gateway_urls: list[str], api_keys: list[str], model: str,
                 request_timeout_s: float, bar: tqdm) -> ReplayResult:
    """The routing runs' view of scenario_replay.replay_traced (the one loop)."""
    traced = await replay_traced(requests, gateway_urls, api_keys, model, request_timeout_s, bar)
    delays = [max(0.0, done.sent_at - traced.started_at - request.arrival_s)
              for done, request in zip(traced.requests, requests)]
    return ReplayResult(traced.outcomes, delays, traced.duration_s)
