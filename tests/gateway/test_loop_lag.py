"""A gateway that is itself late does not blame the pods: a progress
deadline that comes due while the event loop has been running late is put
off (a bounded number of times), so an overloaded gateway no longer ends
every stream as "stalled"; a pod silent while the loop keeps time is still
given up on at its timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.loop_lag import LoopLag
from gateway.pods.deadline import MAX_LAG_EXTENSIONS, NoProgress, ProgressDeadline


class SilentCall:
    """A stream that sends `message` after `after_s` seconds (never, if None)."""

    def __init__(self, after_s: float | None, message: str = "report") -> None:
        self.after_s = after_s
        self.message = message

    async def read(self):
        if self.after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.after_s)
        return self.message


class FixedLag(LoopLag):
    def __init__(self, lag_s: float) -> None:
        super().__init__()
        self.lag_s = lag_s

    def max_lag(self, window_s: float) -> float:
        return self.lag_s


def test_the_monitor_sees_a_blocked_loop():
    async def run() -> tuple[float, float]:
        lag = LoopLag()
        lag.start()
        await asyncio.sleep(0.35)
        quiet = lag.max_lag(10)
        time.sleep(0.5)  # the loop is blocked: the next wake-up comes half a second late
        await asyncio.sleep(0.25)
        lag.stop()
        return quiet, lag.max_lag(10)

    quiet, blocked = asyncio.run(run())
    assert quiet < 0.2 and blocked >= 0.4


def test_a_silent_pod_is_given_up_on_at_its_timeout_when_the_loop_keeps_time():
    async def run():
        deadline = ProgressDeadline(0.2, "load report", FixedLag(0.0))
        start = time.monotonic()
        with pytest.raises(NoProgress, match="no load report for 0.2 s"):
            await deadline.read(SilentCall(None))
        return time.monotonic() - start

    assert 0.19 < asyncio.run(run()) < 0.5


def test_a_late_loop_puts_the_deadline_off_and_the_message_arrives():
    async def run():
        deadline = ProgressDeadline(0.2, "load report", FixedLag(0.2))  # lag > 25% of the timeout
        return await deadline.read(SilentCall(0.5))  # due at 0.2 s, 0.4 s: put off; arrives at 0.5 s

    assert asyncio.run(run()) == "report"


def test_a_late_loop_only_puts_it_off_a_few_times():
    async def run():
        deadline = ProgressDeadline(0.1, "load report", FixedLag(1.0))
        start = time.monotonic()
        with pytest.raises(NoProgress):
            await deadline.read(SilentCall(None))
        return time.monotonic() - start

    elapsed = asyncio.run(run())
    assert (MAX_LAG_EXTENSIONS + 1) * 0.1 - 0.01 < elapsed < (MAX_LAG_EXTENSIONS + 1) * 0.1 + 0.3


def test_expire_still_ends_a_read_at_once_whatever_the_lag():
    async def run():
        deadline = ProgressDeadline(10.0, "response", FixedLag(5.0))
        asyncio.get_running_loop().call_later(0.05, deadline.expire, "engine pod stalled: test")
        start = time.monotonic()
        with pytest.raises(NoProgress, match="engine pod stalled: test"):
            await deadline.read(SilentCall(None))
        return time.monotonic() - start

    assert asyncio.run(run()) < 1.0


def test_a_burst_of_pool_changes_refreshes_admission_once(tiny_llama, tmp_path):
    """Every load report calls the pool's on_change; refreshing the admission
    capacity walks every pod, so a burst of changes is applied once."""
    from gateway.config import gateway_config_from_dict
    from gateway.main import build_gateway
    from gateway.serving import CAPACITY_REFRESH_S

    config = gateway_config_from_dict({"model": {"name": "tiny", "path": str(tiny_llama)},
                                       "pods": {"static": [{"address": "127.0.0.1:1"}]}})

    async def run() -> int:
        gateway = build_gateway(config)
        refreshes = 0
        refresh = gateway._refresh_capacity

        def counted() -> None:
            nonlocal refreshes
            refreshes += 1
            refresh()

        gateway._refresh_capacity = counted
        for _ in range(200):
            gateway._on_pool_change()
        await asyncio.sleep(CAPACITY_REFRESH_S * 3)
        gateway._on_pool_change()  # a later change gets its own refresh
        await asyncio.sleep(CAPACITY_REFRESH_S * 3)
        await gateway.close()
        return refreshes

    assert asyncio.run(run()) == 2
