"""The replay of every scenario (replay.py gives the routing runs' view of
it): the open loop of replay.py's docstring (trace arrival times, a
conversation's turn after the previous one ended, requests alternating
between gateways, one session per tenant), and for each request what
serve's RequestOutcome does not keep: when it was sent, on the run's clock,
and how it ended.

How a request ends:
- ok: [DONE] after its tokens.
- failed_before_streaming: the gateway answered an error (an HTTP error
  status, or an error event) before any token.
- failed_after_streaming: tokens, then an error event from the gateway.
- lost: no answer and no error: the connection closed or reset without an
  error event, the stream ended without [DONE], or nothing came within
  --request-timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from tessera_tools.bench.fleet.workload import FleetRequest
from tessera_tools.bench.serve.client import ServeClient, Target
from tessera_tools.bench.serve.dataset import ServeRequest
from tessera_tools.bench.serve.stream import RequestOutcome, StreamRecorder, carries_token

ENDINGS = ("ok", "failed_before_streaming", "failed_after_streaming", "lost")


@dataclass(frozen=True)
class TracedRequest:
    outcome: RequestOutcome
    ending: str
    """One of ENDINGS."""
    sent_at: float
    """time.monotonic() when it was sent."""
    tokens_seen: int
    """Token-carrying chunks that arrived, failed requests included."""
    requested_tokens: int

    @property
    def first_token_at(self) -> float | None:
        return None if not self.outcome.ok else self.sent_at + self.outcome.ttft_s


@dataclass
class TracedReplay:
    requests: list[TracedRequest]
    """In request order."""
    started_at: float
    """time.monotonic() of the trace's offset 0."""
    ended_at: float
    """time.monotonic() when the last request ended."""

    @property
    def outcomes(self) -> list[RequestOutcome]:
        return [r.outcome for r in self.requests]

    @property
    def duration_s(self) -> float:
        return self.ended_at - self.started_at


class _Recorder(StreamRecorder):
    """StreamRecorder that also counts the tokens a failed stream brought
    and whether the server itself reported the failure."""

    def __init__(self, sent_at: float, prompt_len: int) -> None:
        super().__init__(sent_at, prompt_len)
        self.tokens = 0
        self.server_error = False

    def on_event(self, at: float, event: dict | str) -> None:
        if isinstance(event, dict):
            if "error" in event:
                self.server_error = True
            elif (choices := event.get("choices")) and carries_token(choices[0]):
                self.tokens += 1
        super().on_event(at, event)

    def fail(self, at: float, error: str) -> None:
        if error.startswith("HTTP "):  # the gateway answered with an error status
            self.server_error = True
        super().fail(at, error)

    def ending(self, outcome: RequestOutcome) -> str:
        if outcome.ok:
            return "ok"
        if self.server_error:
            return "failed_after_streaming" if self.tokens else "failed_before_streaming"
        return "lost"


def _serve_request(request: FleetRequest) -> ServeRequest:
    return ServeRequest(output_len=request.output_len, prompt=request.prompt_token_ids,  # type: ignore[arg-type]
                        prompt_len=len(request.prompt_token_ids))


async def replay_traced(requests: list[FleetRequest], gateway_urls: list[str], api_keys: list[str], model: str,
                        request_timeout_s: float, bar: tqdm,
                        on_start: Callable[[float], None] | None = None) -> TracedReplay:
    """`on_start(t0)` is called with the trace's offset 0 (time.monotonic())
    before the first request is due."""
    targets = [Target(url + "/v1", "completions", model) for url in gateway_urls]
    ended = [asyncio.Event() for _ in requests]
    failed = [0]
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for tenant in sorted({r.tenant for r in requests}):
            client = ServeClient(targets[0].base_url, api_keys[tenant], request_timeout_s)
            clients[tenant] = await stack.enter_async_context(client)
        start = time.monotonic()
        if on_start is not None:
            on_start(start)

        async def one(index: int, request: FleetRequest) -> TracedRequest:
            await asyncio.sleep(max(0.0, start + request.arrival_s - time.monotonic()))
            if request.after is not None:
                await ended[request.after].wait()
            sent_at = time.monotonic()
            recorder = _Recorder(time.perf_counter(), len(request.prompt_token_ids))
            try:
                outcome = await clients[request.tenant].send(targets[index % len(targets)], _serve_request(request),
                                                             recorder=recorder)
            finally:
                ended[index].set()
            bar.update(1)
            if not outcome.ok:
                failed[0] += 1
                bar.set_postfix(failed=failed[0], refresh=False)
            return TracedRequest(outcome, recorder.ending(outcome), sent_at, recorder.tokens, request.output_len)

        traced = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        end = time.monotonic()
    return TracedReplay(list(traced), start, end)
