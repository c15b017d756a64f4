"""Tells a wedged engine loop from a busy one.

The gRPC side of a pod runs on its own thread, so it keeps answering health
checks and load reports while the engine loop is stuck in one step (a
stopped tensor-parallel worker, a hung kernel or collective): without this,
every stream on the pod waits forever and the gateway keeps routing to it.
When one step has run longer than ``--step-timeout`` the pod says so: its
load reports carry ``stalled`` (the gateway ends the pod's streams and
routes around it) and its health turns NOT_SERVING (the kubelet takes it out
of its Service and, if it stays wedged, restarts it). Both turn back when
the step ends.
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health_pb2

logger = logging.getLogger(__name__)


async def watch_steps(engine, service, set_health, timeout_s: float) -> None:
    """Until cancelled: flip ``service.stalled`` (and health) as the running
    step crosses ``timeout_s``. ``set_health`` is the frontend's coroutine."""
    period = min(1.0, timeout_s / 4)
    while True:
        await asyncio.sleep(period)
        running = engine.step_running_for()
        stalled = running > timeout_s
        if stalled == service.stalled:
            continue
        service.stalled = stalled
        if stalled:
            logger.error("engine loop stalled: one step has run %.1f s (--step-timeout %g s); "
                         "reporting stalled and NOT_SERVING until it ends", running, timeout_s)
        else:
            logger.warning("engine loop recovered: the stalled step ended")
        if service.serving:  # a draining pod stays NOT_SERVING
            await set_health(health_pb2.HealthCheckResponse.NOT_SERVING if stalled
                             else health_pb2.HealthCheckResponse.SERVING)
