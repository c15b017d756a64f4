"""What a pod's load report counts as waiting: requests handed to the engine
but not yet taken in by its loop count too (a report sent between a request's
arrival and the next step showed the pod with room, and the gateway sent it
more), background ones never."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from engine_pod.config import SchedulerConfig
from engine_pod.core.background import BackgroundShare
from engine_pod.server.async_engine import AsyncEngine, LoadSnapshot
from tests.engine_pod.core.scheduler_helpers import make_req

BACKGROUND = 20


def _engine(loop) -> AsyncEngine:
    config = SchedulerConfig(policy="priority", background_priority=BACKGROUND)
    core = SimpleNamespace(num_blocks=16, scheduler=SimpleNamespace(background=BackgroundShare(config)))
    return AsyncEngine(core, loop)  # its loop thread never starts: every request stays pending


def test_requests_not_yet_taken_in_count_as_waiting_background_ones_never():
    loop = asyncio.new_event_loop()
    try:
        engine = _engine(loop)
        assert engine.num_queued_foreground() == 0
        engine.add_request(make_req("interactive-0", 4))
        engine.add_request(make_req("interactive-1", 4, priority=BACKGROUND - 1))
        engine.add_request(make_req("batch-0", 4, priority=BACKGROUND))
        assert engine.num_queued_foreground() == 2
        assert engine.num_queued() == 3
        # The last step's own count adds to the pending ones.
        engine.snapshot = LoadSnapshot(num_waiting=5, num_waiting_foreground=4)
        assert engine.num_queued_foreground() == 6
    finally:
        loop.close()
