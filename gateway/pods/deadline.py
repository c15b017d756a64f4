"""Progress deadlines: how long a streaming call to an engine pod may wait
for its next message.

A stopped or wedged pod keeps its TCP connection open, so its calls never
fail by themselves: without a deadline they wait forever. Every read of a
load stream (Engine.StreamLoad) or a generation (Engine.Generate) goes
through a `ProgressDeadline`, which ends the read with `NoProgress` when the
pod stays silent too long, or at once when the pool declares the pod
stalled (`expire`: its load reports stopped). The pool keeps the deadlines
of each pod's Generate calls (`Pod.calls`) for that purpose.
"""

from __future__ import annotations

import asyncio


class NoProgress(Exception):
    """A call to an engine pod made no progress in time; the message says why."""


class ProgressDeadline:
    def __init__(self, timeout_s: float, waiting_for: str) -> None:
        # Longest wait for one message.
        self.timeout_s = timeout_s
        # What a read waits for, for the error message ("load report").
        self.waiting_for = waiting_for
        # Why the pool gave up on the call's pod; set once, never cleared.
        self.expired_reason: str | None = None
        # The running read's timeout (None between reads).
        self._timeout: asyncio.Timeout | None = None

    async def read(self, call):
        """The call's next message (or grpc.aio.EOF); NoProgress if none
        comes within `timeout_s` or the deadline is expired meanwhile."""
        if self.expired_reason is not None:
            raise NoProgress(self.expired_reason)
        try:
            async with asyncio.timeout(self.timeout_s) as self._timeout:
                return await call.read()
        except TimeoutError:
            # Only our own timeout ends up here: asyncio.timeout turns its
            # cancellation into TimeoutError, any other cancellation passes.
            raise NoProgress(self.expired_reason or f"no {self.waiting_for} for {self.timeout_s:g} s") from None
        finally:
            self._timeout = None

    def expire(self, reason: str) -> None:
        """End the call's current or next read now with NoProgress(reason).
        The read's task sees its own timeout fire, so this works from any
        task of the loop and never cancels anything else."""
        if self.expired_reason is None:
            self.expired_reason = reason
        if self._timeout is not None and not self._timeout.expired():
            self._timeout.reschedule(asyncio.get_running_loop().time())
