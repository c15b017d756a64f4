"""Admission: tenant rate limits, then pool capacity, then the fair queue.

The controller keeps a slot budget: how many more requests the engine pool
can take right now. The gateway sets it from every fresh batch of pod load
reports (`set_capacity`); each admission spends a slot and each finished
request gives one back, so the budget stays roughly right between reports.
A request admitted but not yet sent to a pod (tokenized, routed, its prefix
queries answered) is in no pod's count yet: `set_capacity` leaves its slot
spent until `Ticket.placed`, or each refresh would hand it out again.
While the budget is spent, sheddable classes are rejected at once and other
requests wait in the fair queue for a slot.

Everything runs on the event loop thread: no locks, and the queue's state
changes only in synchronous code.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from gateway.admission.fair_queue import FairQueue
from gateway.admission.rate_limit import RETRY_HINT_S, Clock, Rejected, TenantLimiter
from gateway.priority import PriorityClass
from gateway.tenants import Tenant

_QUEUED, _DISPATCHED, _GONE = "queued", "dispatched", "gone"


class Ticket:
    """One admitted request; release it exactly when the request ends.

    tokens_per_minute is charged up front for the prompt and the output the
    request may generate (`reserved_output_tokens`, n x max_tokens), so one
    request cannot overrun the limit; `release` gives back what it did not
    generate."""

    def __init__(self, controller: AdmissionController, tenant: Tenant, priority_class: PriorityClass,
                 limiter: TenantLimiter, prompt_tokens: int, queue_wait_s: float, reserved_output_tokens: int = 0):
        self.tenant = tenant
        self.priority_class = priority_class
        self.prompt_tokens = prompt_tokens
        # Output tokens charged at admission, and those generated so far.
        self.reserved_output_tokens = reserved_output_tokens
        self.output_tokens = 0
        # Time spent in the gateway's queue (injected clock); 0.0 if admitted at once.
        self.queue_wait_s = queue_wait_s
        self._controller = controller
        self._limiter = limiter
        self._released = False
        self._placed = False
        controller._unplaced += 1

    @property
    def released(self) -> bool:
        return self._released

    def charge_output_tokens(self, n: int) -> None:
        """Count generated tokens as they stream; those beyond the
        reservation are billed to tokens_per_minute at once."""
        if n < 0:
            raise ValueError("output tokens must be >= 0")
        before = self.output_tokens
        self.output_tokens += n
        beyond = max(0, self.output_tokens - self.reserved_output_tokens) - max(0, before - self.reserved_output_tokens)
        if beyond:
            self._limiter.charge_output(beyond)

    def placed(self) -> None:
        """An entry pod (mixed or decode) took the request's first engine call:
        that pod's count (Pod.dispatched_since_report, then its load report)
        holds it from now on. Safe to call again."""
        if not self._placed:
            self._placed = True
            self._controller._unplaced -= 1

    def release(self) -> None:
        """The request finished, failed or was cancelled: settle its token
        reservation with what it generated. Safe to call twice."""
        if self._released:
            return
        self._released = True
        self.placed()  # never placed (failed or cancelled before): no longer pending either
        self._limiter.finish(unused_tokens=max(0, self.reserved_output_tokens - self.output_tokens))
        self._controller._slot_freed()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


@dataclass(eq=False)  # identity equality: the queue finds a waiter by `is`
class _Waiter:
    tenant: Tenant
    pclass: PriorityClass
    limiter: TenantLimiter
    prompt_tokens: int
    output_tokens: int  # reserved: n x max_tokens
    future: asyncio.Future
    enqueued_at: float
    status: str = _QUEUED
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    ticket: Ticket | None = None


class AdmissionController:
    def __init__(self, clock: Clock = time.monotonic, max_queue_len: int = 1024, queue_timeout_s: float = 60.0):
        if max_queue_len < 0 or queue_timeout_s <= 0:
            raise ValueError("admission: max_queue_len must be >= 0 and queue_timeout_s > 0")
        self._clock = clock
        self._max_queue_len = max_queue_len
        self._queue_timeout_s = queue_timeout_s
        self._limiters: dict[str, TenantLimiter] = {}
        self._queue: FairQueue[_Waiter] = FairQueue()
        # No pod stats yet: do not hold requests back on a guess.
        self._budget: float = math.inf
        # Tickets issued whose request no pod counts yet (Ticket.placed).
        self._unplaced = 0

    # ---- observation -------------------------------------------------
    @property
    def queue_len(self) -> int:
        return len(self._queue)

    def queue_len_by_class(self) -> dict[str, int]:
        return self._queue.len_by_class()

    @property
    def free_slots(self) -> float:
        """The current slot budget (math.inf before the first set_capacity)."""
        return self._budget

    @property
    def saturated(self) -> bool:
        return self._budget <= 0

    def in_flight(self, tenant_name: str) -> int:
        limiter = self._limiters.get(tenant_name)
        return limiter.in_flight if limiter else 0

    # ---- capacity ----------------------------------------------------
    def set_capacity(self, free_slots: int) -> None:
        """Fresh pod load reports: the pool can take `free_slots` more requests
        now, less those admitted that no pod has counted yet."""
        self._budget = free_slots - self._unplaced
        self._dispatch()

    def _slot_freed(self) -> None:
        self._budget += 1
        self._dispatch()

    # ---- admission ---------------------------------------------------
    async def admit(self, tenant: Tenant, pclass: PriorityClass, prompt_tokens: int,
                    output_tokens: int = 0) -> Ticket:
        """A Ticket once the request may go to the pool; raises Rejected.
        `output_tokens` is the most it may generate (n x max_tokens), reserved
        against tokens_per_minute with the prompt."""
        if prompt_tokens < 0 or output_tokens < 0:
            raise ValueError("prompt_tokens and output_tokens must be >= 0")
        limiter = self._limiter(tenant)
        limiter.check(prompt_tokens, output_tokens)
        # Newcomers may not overtake requests already waiting.
        must_wait = self.saturated or len(self._queue) > 0
        if must_wait:
            self._check_can_queue(pclass)
        limiter.take(prompt_tokens + output_tokens)
        if not must_wait:
            self._budget -= 1
            return Ticket(self, tenant, pclass, limiter, prompt_tokens, 0.0, output_tokens)
        return await self._wait(tenant, pclass, limiter, prompt_tokens, output_tokens)

    def _limiter(self, tenant: Tenant) -> TenantLimiter:
        limiter = self._limiters.get(tenant.name)
        if limiter is None:
            limiter = self._limiters[tenant.name] = TenantLimiter(tenant.limits, self._clock)
        elif limiter.limits != tenant.limits:
            limiter.configure(tenant.limits)  # the tenants file was reloaded
        return limiter

    def _check_can_queue(self, pclass: PriorityClass) -> None:
        if pclass.sheddable:
            raise Rejected("shed", f"the service is at capacity and priority class {pclass.name!r} "
                                   "is shed under load; retry later", RETRY_HINT_S)
        if len(self._queue) >= self._max_queue_len:
            raise Rejected("queue_full", f"the service is at capacity and its queue is full "
                                         f"(max_queue_len {self._max_queue_len}); retry later", RETRY_HINT_S)

    async def _wait(self, tenant: Tenant, pclass: PriorityClass, limiter: TenantLimiter,
                    prompt_tokens: int, output_tokens: int) -> Ticket:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(tenant, pclass, limiter, prompt_tokens, output_tokens, loop.create_future(), self._clock())
        self._queue.push(waiter, class_name=pclass.name, weight=pclass.weight, rank=pclass.priority,
                         tenant=tenant.name)
        # The timeout runs on the loop's clock: only it can wake a sleeping waiter.
        waiter.timer = loop.call_later(self._queue_timeout_s, self._expire, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: _Waiter) -> None:
        """The awaiting task was cancelled (client gone): undo whatever it holds."""
        if waiter.status == _QUEUED:
            self._drop(waiter)
        elif waiter.status == _DISPATCHED and waiter.ticket is not None:
            # Dispatched, but cancelled before it resumed: nobody will release it.
            waiter.ticket.release()

    def _drop(self, waiter: _Waiter) -> None:
        """Out of the queue without ever running: refund its limits."""
        self._queue.remove(waiter, class_name=waiter.pclass.name, tenant=waiter.tenant.name)
        waiter.status = _GONE
        if waiter.timer is not None:
            waiter.timer.cancel()
        waiter.limiter.refund(waiter.prompt_tokens + waiter.output_tokens)

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.status != _QUEUED:
            return
        self._drop(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(Rejected(
                "queue_timeout", f"the request waited {self._queue_timeout_s:g} s in the queue without "
                                 "capacity becoming free", RETRY_HINT_S))

    def _dispatch(self) -> None:
        while self._budget > 0 and len(self._queue) > 0:
            waiter = self._queue.pop()
            waiter.status = _DISPATCHED
            if waiter.timer is not None:
                waiter.timer.cancel()
            if waiter.future.done():
                # Cancelled, and its task has not run its cleanup yet: never ran.
                waiter.status = _GONE
                waiter.limiter.refund(waiter.prompt_tokens + waiter.output_tokens)
                continue
            self._budget -= 1
            waiter.ticket = Ticket(self, waiter.tenant, waiter.pclass, waiter.limiter, waiter.prompt_tokens,
                                   self._clock() - waiter.enqueued_at, waiter.output_tokens)
            waiter.future.set_result(waiter.ticket)
