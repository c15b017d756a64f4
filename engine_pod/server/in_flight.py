"""Request-seconds in flight on a pod: the integral over time of the number
of requests it holds (from the engine taking a request to its stream's end).

Exported as a counter, its rate over any interval is the pod's mean
concurrency over that interval. The autoscaler reads it there instead of
the running and waiting gauges, which a scrape samples at one instant:
at a few pods and a few requests each, one sample can be off by a factor
of ten from the interval's mean (docs/benchmarks.md, autoscaling).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class InFlightSeconds:
    """Set by the pod's event loop when its count of requests changes; read
    by the metrics server's thread, hence the lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._count = 0
        self._since = clock()
        self._total = 0.0

    def set(self, count: int) -> None:
        """The number of requests in flight from now on."""
        with self._lock:
            now = self._clock()
            self._total += self._count * (now - self._since)
            self._count, self._since = count, now

    def total(self) -> float:
        """Request-seconds up to now."""
        with self._lock:
            return self._total + self._count * (self._clock() - self._since)
