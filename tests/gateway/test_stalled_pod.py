"""A real engine pod stopped (SIGSTOP keeps its connection open, so nothing
fails by itself) behind a real gateway: it is ejected once its load reports
are `router.load_timeout_s` late, the requests on it end or are retried,
and it rejoins when it continues. The deadlines themselves are tested
against fake pods in tests/gateway/test_progress_deadlines.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tests.gateway.conftest import MODEL_NAME, POD_ARGS, gateway_config
from tests.gateway.observe import aborted, in_flight, metric_sum, sse_data, until

# -- a real stopped pod -----------------------------------------------------

LOAD_TIMEOUT_S = 2.0
# The acceptance bound: nothing waits longer than the deadline + 2 s.
BOUND_S = LOAD_TIMEOUT_S + 2.0
IN_FLIGHT = 8
ROUTING = "tessera_gateway_routing_decisions_total"


@pytest.fixture(scope="module")
def stoppable(tiny_llama, tmp_path_factory):
    """Two pods of this module's own (the session's pods are never stopped)
    behind a gateway that declares a pod stalled after 2 s without a
    report. Round robin makes the split between the pods deterministic."""
    work = tmp_path_factory.mktemp("stalled")
    with EnginePodProcess(tiny_llama, POD_ARGS, log_path=work / "a.log") as a, \
            EnginePodProcess(tiny_llama, POD_ARGS, log_path=work / "b.log") as b:
        a.wait_serving()
        b.wait_serving()
        router = {"policy": "round_robin", "load_interval_ms": 100, "load_timeout_s": LOAD_TIMEOUT_S,
                  "reprobe_interval_s": 0.2}
        config = gateway_config(tiny_llama, [(a, "mixed"), (b, "mixed")], router=router)
        with GatewayProcess(config, work, log_path=work / "gateway.log") as gw:
            gw.wait_ready(num_pods=2)
            yield a, b, gw


def _new_result() -> dict:
    return {"sent": time.monotonic(), "times": [], "done": False, "error": None, "status": None, "end": None}


async def _stream(http: httpx.AsyncClient, url: str, i: int, max_tokens: int, result: dict) -> dict:
    """One streamed completion into `result`, with the time of every chunk."""
    body = {"model": MODEL_NAME, "prompt": f"stalled pod request {i}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            result["status"] = r.status_code
            async for data in sse_data(r):
                if data == "[DONE]":
                    result["done"] = True
                elif "error" in data:
                    result["error"] = data["error"]
                else:
                    result["times"].append(time.monotonic())
    finally:
        result["end"] = time.monotonic()
    return result


def _longest_wait(r: dict, since: float) -> float:
    """The longest the client waited for anything after `since`."""
    marks = [since] + [t for t in r["times"] if t > since] + [r["end"]]
    return max(later - earlier for earlier, later in zip(marks, marks[1:]))


def _routed(gw, **labels) -> float:
    return metric_sum(gw.metrics_url, ROUTING, **labels)


async def _requests(gw, first: int, count: int, max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as http:
        return await asyncio.gather(*(_stream(http, gw.base_url, first + i, max_tokens, _new_result())
                                      for i in range(count)))


async def _while_stopped(a, b, gw) -> None:
    """Streams on both pods; SIGSTOP b once each has a token, and two more
    requests at once (round robin sends one to b before it is ejected)."""
    retries = _routed(gw, kind="retry")
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as http:
        running = [_new_result() for _ in range(IN_FLIGHT)]
        tasks = [asyncio.create_task(_stream(http, gw.base_url, i, 200, r)) for i, r in enumerate(running)]
        await until(lambda: all(r["times"] for r in running), timeout=60)
        os.kill(b.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        late = [_new_result() for _ in range(2)]
        tasks += [asyncio.create_task(_stream(http, gw.base_url, 100 + i, 16, r)) for i, r in enumerate(late)]
        await asyncio.gather(*tasks)
    broken = [r for r in running if r["error"] is not None]
    # b's streams had tokens: each ends with an error event, soon after the
    # deadline (never before: timers do not fire early).
    assert broken, running
    for r in broken:
        assert r["status"] == 200 and r["times"] and r["error"]["message"]
        assert "stalled" in r["error"]["message"]
        assert LOAD_TIMEOUT_S / 2 <= r["end"] - stopped <= BOUND_S, r["end"] - stopped
    # a's streams complete; the late request that went to b is retried on a.
    for r in running + late:
        assert r in broken or (r["done"] and r["error"] is None), r
        assert _longest_wait(r, stopped) <= BOUND_S
    assert all(len(r["times"]) > 0 for r in late)
    assert _routed(gw, kind="retry") - retries >= 1
    waits = [round(r["end"] - stopped, 2) for r in broken] + [round(r["times"][0] - stopped, 2) for r in late]
    print(f"\nstopped-pod test: {len(broken)} broken streams ended, late first tokens at (s after the stop): {waits}")

    # Ejected: new requests all go to a, and finish within the bound.
    assert gw.health()["pods"] == 1
    routed_a, routed_b = _routed(gw, pod=a.address), _routed(gw, pod=b.address)
    fresh = await _requests(gw, 200, 4, 8)
    assert all(r["done"] and r["error"] is None for r in fresh), fresh
    assert all(r["end"] - r["sent"] <= BOUND_S for r in fresh)
    assert _routed(gw, pod=b.address) == routed_b and _routed(gw, pod=a.address) - routed_a == 4
    print("stopped-pod test: new requests took (s):", [round(r["end"] - r["sent"], 2) for r in fresh])


def test_stopped_pod_is_ejected_its_requests_end_or_retry_and_it_rejoins(stoppable):
    a, b, gw = stoppable
    aborted_before = aborted(b)
    try:
        asyncio.run(_while_stopped(a, b, gw))
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    gw.wait_ready(num_pods=2, timeout=30)
    print(f"stopped-pod test: routable again {time.monotonic() - resumed:.2f} s after SIGCONT")
    # The streams the gateway ended reach the pod as cancellations once it
    # runs again: it aborts them (round robin put half the streams there).
    deadline = time.monotonic() + 15
    while aborted(b) - aborted_before < IN_FLIGHT // 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted(b) - aborted_before >= IN_FLIGHT // 2 and in_flight(b) == 0
    routed_b = _routed(gw, pod=b.address)
    again = asyncio.run(_requests(gw, 300, 4, 8))
    assert all(r["done"] and r["error"] is None for r in again), again
    assert _routed(gw, pod=b.address) > routed_b
