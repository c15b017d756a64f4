"""How late this process's event loop runs.

A gateway whose loop is saturated (a fan-out of queries to every pod, a
burst of requests) reads every pod's load reports late. It must not take its
own lag for the pods' silence: declaring them stalled ends every stream on
them, and at 128 pods under the `score` policy that turned an overload into
nine requests in ten failed. Progress deadlines ask this monitor before
they give up on a pod (gateway/pods/deadline.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

# How often the loop's lateness is sampled, and how much history is kept.
PERIOD_S = 0.1
HISTORY_S = 60.0


class LoopLag:
    def __init__(self) -> None:
        # (monotonic time of the sample, seconds the wake-up came late)
        self._samples: deque[tuple[float, float]] = deque(maxlen=int(HISTORY_S / PERIOD_S))
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(PERIOD_S)
            now = time.monotonic()
            self._samples.append((now, max(0.0, now - before - PERIOD_S)))

    def max_lag(self, window_s: float) -> float:
        """The worst lateness of the last ``window_s`` seconds (0 without samples)."""
        since = time.monotonic() - window_s
        return max((lag for at, lag in self._samples if at >= since), default=0.0)
