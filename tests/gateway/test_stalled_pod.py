"""Progress deadlines: a pod that stops answering (SIGSTOP keeps its
connection open, so nothing fails by itself) is ejected once its load
reports are `router.load_timeout_s` late, and the requests on it end or are
retried; a Generate stream silent for `router.stream_idle_timeout_s` ends
the same way.

The first tests drive the pool and the engine calls against fake pods
(their calls follow grpc.aio's `read()` API); the last one stops a real
engine pod behind a real gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time

import grpc
import httpx
import pytest

import gateway.pods.pool as pool_module
from engine_pod.server.process import EnginePodProcess
from gateway.config import AdmissionConfig, GatewayConfigError, RouterConfig, gateway_config_from_dict
from gateway.engine_call import prefill, stream_choice
from gateway.errors import StreamBroken
from gateway.pods import Pod, PodPool
from gateway.pods.deadline import NoProgress, ProgressDeadline
from gateway.process import GatewayProcess
from tessera.v1 import engine_pb2 as epb
from tests.gateway.conftest import MODEL_NAME, POD_ARGS, gateway_config
from tests.gateway.observe import aborted, in_flight, metric_sum, sse_data

# -- fake pods ------------------------------------------------------------


class FakeProcess:
    """A fake pod's process: stop() is SIGSTOP (calls stay open and hear
    nothing), resume() is SIGCONT."""

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.running.set()

    def stop(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()


class FakeCall:
    """A server stream as grpc.aio's `read()` gives it."""

    def __init__(self, process: FakeProcess, messages, silent_after: int | None = None) -> None:
        self.process = process
        self.messages = iter(messages)
        # Messages sent before the stream goes silent for good (None: never).
        self.silent_after = silent_after
        self.sent = 0
        self.cancelled = False

    async def read(self):
        await asyncio.sleep(0.01)
        await self.process.running.wait()
        if self.silent_after is not None and self.sent >= self.silent_after:
            await asyncio.Event().wait()
        self.sent += 1
        return next(self.messages, grpc.aio.EOF)

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def done(self) -> bool:
        return self.cancelled


TOKENS = 5


class FakeStub:
    def __init__(self) -> None:
        self.process = FakeProcess()
        self.load_calls: list[FakeCall] = []
        # Generate responses before its streams go silent (None: never).
        self.generate_silent_after: int | None = None
        # The pod reports its engine loop wedged in one step (still reporting).
        self.stalled = False

    def StreamLoad(self, request):
        # The stub's `stalled` as of each report: the pod's step watchdog.
        reports = (epb.LoadReport(role="mixed", serving=True, stalled=self.stalled) for _ in itertools.count())
        self.load_calls.append(FakeCall(self.process, reports))
        return self.load_calls[-1]

    def Generate(self, request, metadata=None):
        responses = [epb.GenerateResponse(token_ids=[7]) for _ in range(TOKENS - 1)]
        responses.append(epb.GenerateResponse(token_ids=[7], finish_reason="length"))
        return FakeCall(self.process, responses, self.generate_silent_after)


class _FakeChannel:
    async def close(self, grace=None) -> None:
        pass


class FakePod(Pod):
    def __post_init__(self) -> None:
        self.channel = _FakeChannel()
        self.stub = FakeStub()


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _fake_pool(**router) -> tuple[PodPool, Pod, Pod]:
    """Pods a:1 and b:1, both reporting (every ~10 ms), with watchers."""
    config = RouterConfig(load_interval_ms=10, reprobe_interval_s=0.05, **router)
    pool = PodPool(config, AdmissionConfig())
    pool.set_members("mixed", ["a:1", "b:1"])
    await _until(lambda: len(pool.routable()) == 2)
    return pool, pool.pods["a:1"], pool.pods["b:1"]


def _generate(pool: PodPool, candidates: list[Pod], tried: list[str] | None = None):
    def on_attempt(pod: Pod, attempt: int) -> None:
        if tried is not None:
            tried.append(pod.address)

    return stream_choice(pool, candidates, epb.GenerateRequest(request_id="r"), [], on_attempt)


async def _drain(responses) -> list[epb.GenerateResponse]:
    return [r async for r in responses]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def fake_pods(monkeypatch):
    monkeypatch.setattr(pool_module, "Pod", FakePod)


# -- unit tests -------------------------------------------------------------


def test_silent_load_stream_ejects_the_pod_ends_its_calls_and_rejoins(fake_pods):
    async def scenario():
        timeout = 0.3
        pool, a, b = await _fake_pool(load_timeout_s=timeout)
        free_before = pool.free_slots()
        streaming = _generate(pool, [a, b])
        await streaming.__anext__()  # a token reached the client
        a.stub.process.stop()
        stopped = time.monotonic()
        # Sent before the stall is seen: it goes to a and hears nothing.
        tried: list[str] = []
        fresh = asyncio.create_task(_drain(_generate(pool, [a, b], tried)))
        with pytest.raises(StreamBroken, match="stalled: no load report for 0.3 s"):
            await _drain(streaming)
        ended_after = time.monotonic() - stopped
        assert not a.routable and b.routable
        assert pool.free_slots() < free_before
        # Not before the deadline (timers never fire early; a report may be
        # one 10 ms interval old at the stop), and promptly after it.
        assert timeout - 0.05 <= ended_after < timeout + 3
        responses = await fresh
        assert tried == ["a:1", "b:1"] and responses[-1].finish_reason == "length"
        assert a.stub.load_calls[0].cancelled and not a.calls
        # Still stopped: re-probed, each probe times out, never routable.
        await _until(lambda: len(a.stub.load_calls) >= 3)
        assert not a.routable
        a.stub.process.resume()
        await _until(lambda: a.routable)
        await pool.close()

    _run(scenario())


def test_ejection_for_another_reason_lets_the_pods_streams_finish(fake_pods):
    async def scenario():
        pool, a, _ = await _fake_pool(load_timeout_s=5.0)
        stream = _generate(pool, [a])
        await stream.__anext__()
        # As after a Generate UNAVAILABLE from a draining pod: no new work,
        # but what runs there finishes.
        pool.eject(a, "generate: UNAVAILABLE")
        rest = await _drain(stream)
        assert len(rest) == TOKENS - 1 and rest[-1].finish_reason == "length"
        await pool.close()

    _run(scenario())


def test_a_pod_reporting_its_engine_loop_stalled_gets_no_work_and_its_calls_end(fake_pods):
    """Its reports still come (the gRPC side lives), but they say a step is
    stuck: the calls there end (a fresh one is retried on b), nothing new is
    routed to it, and it rejoins when it reports healthy again."""
    async def scenario():
        pool, a, b = await _fake_pool(load_timeout_s=5.0)
        a.stub.generate_silent_after = 1  # its engine loop stops stepping...
        streaming = _generate(pool, [a, b])
        await streaming.__anext__()
        a.stub.generate_silent_after = 0  # a call sent now hears nothing at all
        tried: list[str] = []
        fresh = asyncio.create_task(_drain(_generate(pool, [a, b], tried)))
        await _until(lambda: len(a.calls) == 2)
        a.stub.stalled = True  # ...and its watchdog says so in the next report
        with pytest.raises(StreamBroken, match="engine loop is stuck in one step"):
            await _drain(streaming)
        responses = await fresh
        assert tried == ["a:1", "b:1"] and responses[-1].finish_reason == "length"
        assert not a.routable and b.routable and not a.calls
        assert pool.routable() == [b]
        a.stub.stalled = False
        await _until(lambda: a.routable)
        await pool.close()

    _run(scenario())


def test_silent_generate_stream_ends_after_the_idle_timeout(fake_pods):
    async def scenario():
        pool, a, b = await _fake_pool(load_timeout_s=5.0, stream_idle_timeout_s=0.3)
        a.stub.generate_silent_after = 1
        stream = _generate(pool, [a, b])
        await stream.__anext__()
        started = time.monotonic()
        with pytest.raises(StreamBroken, match="no response from the engine pod for 0.3 s"):
            await _drain(stream)
        assert 0.25 <= time.monotonic() - started < 3.3
        assert a.routable  # its load reports still come: only the stream is condemned

        # Nothing streamed yet: retried on the next pod.
        a.stub.generate_silent_after = 0
        tried: list[str] = []
        responses = await _drain(_generate(pool, [a, b], tried))
        assert tried == ["a:1", "b:1"] and responses[-1].finish_reason == "length"

        # The prefill half of P/D obeys the same deadline: the decode pod
        # then computes the prompt itself.
        assert await prefill(pool, [a], epb.GenerateRequest(request_id="p"), [], lambda p, i: None) is False
        await pool.close()

    _run(scenario())


def test_progress_deadline_expiry_and_cancellation():
    async def scenario():
        stopped = FakeProcess()
        stopped.stop()
        # Expired while a read waits: that read ends at once, not at the timeout.
        deadline = ProgressDeadline(60.0, "response")
        read = asyncio.create_task(deadline.read(FakeCall(stopped, [])))
        await asyncio.sleep(0.05)
        deadline.expire("engine pod stalled: test")
        with pytest.raises(NoProgress, match="stalled: test"):
            await asyncio.wait_for(read, 5)
        # Expired between reads: the next read ends at once.
        with pytest.raises(NoProgress, match="stalled: test"):
            await deadline.read(FakeCall(FakeProcess(), [epb.LoadReport()]))
        # Cancelling the reader is a cancellation, never a NoProgress.
        read = asyncio.create_task(ProgressDeadline(60.0, "response").read(FakeCall(stopped, [])))
        await asyncio.sleep(0.05)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read

    _run(scenario())


@pytest.mark.parametrize("router,message", [
    ({"load_interval_ms": 1000, "load_timeout_s": 1.5}, "router.load_timeout_s must be >= 2 x router.load_interval_ms"),
    ({"stream_idle_timeout_s": 0}, "router.stream_idle_timeout_s must be > 0"),
    ({"reprobe_interval_s": 0}, "router.reprobe_interval_s must be > 0"),
])
def test_deadline_settings_are_checked(router, message):
    base = {"model": {"name": "m", "path": "/m"}, "pods": {"static": [{"address": "h:1"}]}}
    with pytest.raises(GatewayConfigError, match=message):
        gateway_config_from_dict({**base, "router": router})
    c = gateway_config_from_dict(base).router
    assert c.load_timeout_s == 5.0 and c.stream_idle_timeout_s == 120.0


# -- a real stopped pod -----------------------------------------------------

LOAD_TIMEOUT_S = 2.0
# The acceptance bound: nothing waits longer than the deadline + 2 s.
BOUND_S = LOAD_TIMEOUT_S + 2.0
IN_FLIGHT = 8
ROUTING = "tessera:gateway_routing_decisions_total"


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
        await _until(lambda: all(r["times"] for r in running), timeout=60)
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
