"""Progress deadlines: how long a streaming call to an engine pod may wait
for its next message.

A stopped or wedged pod keeps its TCP connection open, so its calls never
fail by themselves: without a deadline they wait forever. Every read of a
load stream (Engine.StreamLoad) or a generation (Engine.Generate) goes
through a `ProgressDeadline`, which ends the read with `NoProgress` when the
pod stays silent too long, or at once when the pool declares the pod
stalled (`expire`: its load reports stopped). The pool keeps the deadlines
of each pod's Generate calls (`Pod.calls`) for that purpose.

A deadline that comes due while this gateway's own event loop has been
running late (gateway/loop_lag.py) is put off, up to MAX_LAG_EXTENSIONS
times: the silence may be the gateway's, not the pod's.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.loop_lag import LoopLag

logger = logging.getLogger(__name__)

# A deadline is put off while the loop's worst lateness over its timeout
# exceeds this share of it, at most this many times (a truly silent pod is
# still given up on, later).
LAG_SHARE = 0.25
MAX_LAG_EXTENSIONS = 3


class NoProgress(Exception):
    """A call to an engine pod made no progress in time; the message says why."""


class ProgressDeadline:
    def __init__(self, timeout_s: float, waiting_for: str, loop_lag: LoopLag | None = None) -> None:
        # Longest wait for one message.
        self.timeout_s = timeout_s
        # What a read waits for, for the error message ("load report").
        self.waiting_for = waiting_for
        # This process's loop lateness; None: a deadline is never put off.
        self.loop_lag = loop_lag
        # Why the pool gave up on the call's pod; set once, never cleared.
        self.expired_reason: str | None = None
        # The running read's timeout (None between reads), and the timer that ends it.
        self._timeout: asyncio.Timeout | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._extensions = 0

    async def read(self, call):
        """The call's next message (or grpc.aio.EOF); NoProgress if none
        comes within `timeout_s` (put off while the loop lags) or the
        deadline is expired meanwhile."""
        if self.expired_reason is not None:
            raise NoProgress(self.expired_reason)
        loop = asyncio.get_running_loop()
        self._extensions = 0
        try:
            # No timeout of its own: _due ends the read, after asking the loop-lag monitor.
            async with asyncio.timeout(None) as self._timeout:
                self._timer = loop.call_later(self.timeout_s, self._due)
                return await call.read()
        except TimeoutError:
            # Only our own timeout ends up here: asyncio.timeout turns its
            # cancellation into TimeoutError, any other cancellation passes.
            raise NoProgress(self.expired_reason or f"no {self.waiting_for} for {self.timeout_s:g} s") from None
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._timeout = self._timer = None

    def _due(self) -> None:
        if self._timeout is None or self._timeout.expired():
            return
        loop = asyncio.get_running_loop()
        lag = self.loop_lag.max_lag(self.timeout_s) if self.loop_lag is not None else 0.0
        if lag > LAG_SHARE * self.timeout_s and self._extensions < MAX_LAG_EXTENSIONS:
            self._extensions += 1
            logger.warning("no %s for %g s, but this gateway's event loop ran up to %.1f s late meanwhile: "
                           "waiting longer before calling the pod silent", self.waiting_for, self.timeout_s, lag)
            self._timer = loop.call_later(self.timeout_s, self._due)
            return
        self._timeout.reschedule(loop.time())

    def expire(self, reason: str) -> None:
        """End the call's current or next read now with NoProgress(reason).
        The read's task sees its own timeout fire, so this works from any
        task of the loop and never cancels anything else."""
        if self.expired_reason is None:
            self.expired_reason = reason
        if self._timeout is not None and not self._timeout.expired():
            self._timeout.reschedule(asyncio.get_running_loop().time())
