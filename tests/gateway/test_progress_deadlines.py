"""Progress deadlines against fake pods (their calls follow grpc.aio's
`read()` API): a pod whose load reports are `router.load_timeout_s` late is
ejected and the calls on it end (retried elsewhere when nothing was
streamed); a Generate stream silent for `router.stream_idle_timeout_s` ends
the same way. tests/gateway/test_stalled_pod.py does it to a real pod.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc
import pytest

import gateway.pods.pool as pool_module
from gateway.config import AdmissionConfig, GatewayConfigError, RouterConfig, gateway_config_from_dict
from gateway.engine_call import prefill, stream_choice
from gateway.errors import GatewayError, StreamBroken
from gateway.pods import Pod, PodPool
from gateway.pods.deadline import NoProgress, ProgressDeadline
from tessera.v1 import engine_pb2 as epb
from tests.gateway.observe import until

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


async def _fake_pool(**router) -> tuple[PodPool, Pod, Pod]:
    """Pods a:1 and b:1, both reporting (every ~10 ms), with watchers."""
    config = RouterConfig(load_interval_ms=10, reprobe_interval_s=0.05, **router)
    pool = PodPool(config, AdmissionConfig())
    pool.set_members("mixed", ["a:1", "b:1"])
    await until(lambda: len(pool.routable()) == 2)
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
        await until(lambda: len(a.stub.load_calls) >= 3)
        assert not a.routable
        a.stub.process.resume()
        await until(lambda: a.routable)
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
        await until(lambda: len(a.calls) == 2)
        a.stub.stalled = True  # ...and its watchdog says so in the next report
        with pytest.raises(StreamBroken, match="engine loop is stuck in one step"):
            await _drain(streaming)
        responses = await fresh
        assert tried == ["a:1", "b:1"] and responses[-1].finish_reason == "length"
        assert not a.routable and b.routable and not a.calls
        assert pool.routable() == [b]
        a.stub.stalled = False
        await until(lambda: a.routable)
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


def test_a_request_whose_pods_left_before_it_ran_goes_to_the_next_plan(fake_pods):
    """Routed to a pod that left before the call (a pool scaled to zero as
    the request was routed): with `replan` it runs on the next plan's pod;
    without, it ends with no_engine_pod."""
    async def scenario():
        pool, a, b = await _fake_pool()
        replans = 0

        async def replan() -> list[Pod]:
            nonlocal replans
            replans += 1
            await asyncio.sleep(0.1)  # the next pod starts
            return [b]

        tried: list[str] = []
        pool.eject(a, "scaled down")  # no await until the call: it stays out
        responses = await _drain(stream_choice(pool, [a], epb.GenerateRequest(request_id="r"), [],
                                               lambda pod, i: tried.append(pod.address), replan))
        assert tried == ["b:1"] and replans == 1 and responses[-1].finish_reason == "length"

        pool.eject(a, "scaled down")
        with pytest.raises(GatewayError, match="no engine pod") as refused:
            await _drain(_generate(pool, [a]))
        assert refused.value.code == "no_engine_pod"
        await pool.close()

    _run(scenario())


def test_a_request_a_pod_ran_is_not_routed_again(fake_pods):
    """A pod that took the request and went silent may have spent time on
    it: the retries' budget decides, not a new plan."""
    async def scenario():
        pool, a, b = await _fake_pool(load_timeout_s=5.0, stream_idle_timeout_s=0.2)
        a.stub.generate_silent_after = 0

        async def replan() -> list[Pod]:
            raise AssertionError("routed again")

        with pytest.raises(GatewayError, match="no response from the engine pod"):
            await _drain(stream_choice(pool, [a], epb.GenerateRequest(request_id="r"), [], lambda pod, i: None,
                                       replan))
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
