"""Admission: rate limits on a fake clock, capacity budget, shedding, the
queue's limits and cleanup, and the fair dispatch order."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.admission import RETRY_HINT_S, AdmissionController, FairQueue, Rejected, TokenBucket
from gateway.priority import PriorityClass
from gateway.tenants import RateLimits, Tenant

STANDARD = PriorityClass("standard", priority=10, weight=4.0)
BATCH = PriorityClass("batch", priority=20, weight=1.0, sheddable=True)
HIGH = PriorityClass("high", priority=0, weight=4.0)
LOW = PriorityClass("low", priority=20, weight=1.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tenant(name="acme", rpm=None, tpm=None, concurrent=None) -> Tenant:
    return Tenant(name, None, None, RateLimits(rpm, tpm, concurrent), f"tenant:{name}")


def admit_now(ctrl, who, pclass=STANDARD, prompt_tokens=10, output_tokens=0):
    """Admit without queueing (each call its own short loop; nothing waits)."""
    return asyncio.run(ctrl.admit(who, pclass, prompt_tokens, output_tokens))


def rejection(ctrl, who, pclass=STANDARD, prompt_tokens=10, output_tokens=0) -> Rejected:
    with pytest.raises(Rejected) as info:
        admit_now(ctrl, who, pclass, prompt_tokens, output_tokens)
    return info.value


async def settle() -> None:
    """Let every ready task run until it blocks."""
    for _ in range(5):
        await asyncio.sleep(0)


# ---- token bucket ---------------------------------------------------------

def test_token_bucket_take_wait_refill_charge_refund():
    clock = FakeClock()
    bucket = TokenBucket(10, 2, clock)
    assert bucket.try_take(10) is None
    assert bucket.try_take(1) == pytest.approx(0.5)
    assert bucket.try_take(4) == pytest.approx(2.0)  # a refusal takes nothing
    clock.advance(0.5)
    assert bucket.try_take(1) is None
    bucket.charge(6)  # may go negative
    assert bucket.available == pytest.approx(-6)
    assert bucket.time_until(1) == pytest.approx(3.5)
    clock.advance(100)
    assert bucket.available == 10  # refill stops at capacity
    bucket.refund(5)
    assert bucket.available == 10  # so does a refund
    assert bucket.time_until(11) == float("inf")


# ---- per-tenant rate limits ----------------------------------------------

def test_requests_per_minute_limit_and_refill():
    clock = FakeClock()
    ctrl = AdmissionController(clock)
    acme = tenant(rpm=60)  # one request per second refill
    for _ in range(60):
        admit_now(ctrl, acme).release()
    err = rejection(ctrl, acme)
    assert err.reason == "requests_per_minute" and err.retry_after == pytest.approx(1.0)
    assert "requests_per_minute" in err.message and "60" in err.message
    clock.advance(0.25)
    assert rejection(ctrl, acme).retry_after == pytest.approx(0.75)
    clock.advance(0.75)
    admit_now(ctrl, acme)
    # Other tenants have their own buckets.
    admit_now(ctrl, tenant("beta", rpm=60))


def test_tokens_per_minute_limit_prompt_and_output_tokens():
    clock = FakeClock()
    ctrl = AdmissionController(clock)
    acme = tenant(tpm=600)  # refills 10 tokens/s
    ticket = admit_now(ctrl, acme, prompt_tokens=500)
    err = rejection(ctrl, acme, prompt_tokens=200)
    assert err.reason == "tokens_per_minute" and err.retry_after == pytest.approx(10.0)
    assert "600" in err.message
    clock.advance(10)
    admit_now(ctrl, acme, prompt_tokens=200)  # balance now 0
    # Generated tokens are billed afterwards and push the balance below zero.
    ticket.charge_output_tokens(300)
    assert rejection(ctrl, acme, prompt_tokens=50).retry_after == pytest.approx(35.0)


def test_tokens_per_minute_reserves_n_x_max_tokens_and_settles_with_the_real_count():
    clock = FakeClock()
    ctrl = AdmissionController(clock)
    acme = tenant(tpm=600)  # refills 10 tokens/s
    # 100 prompt tokens and up to 400 output tokens (n x max_tokens): 500 reserved.
    ticket = admit_now(ctrl, acme, prompt_tokens=100, output_tokens=400)
    assert ticket.reserved_output_tokens == 400
    err = rejection(ctrl, acme, prompt_tokens=50, output_tokens=100)  # needs 150, 100 left
    assert err.reason == "tokens_per_minute" and err.retry_after == pytest.approx(5.0)
    # It generated 150 of its 400: settling gives 250 back.
    ticket.charge_output_tokens(100)
    ticket.charge_output_tokens(50)
    ticket.release()
    ticket.release()  # settles once
    admit_now(ctrl, acme, prompt_tokens=50, output_tokens=100)  # 350 available, 150 taken
    err = rejection(ctrl, acme, prompt_tokens=100, output_tokens=101)
    assert err.retry_after == pytest.approx(0.1)


def test_output_beyond_the_reservation_is_billed_as_it_streams():
    clock = FakeClock()
    ctrl = AdmissionController(clock)
    acme = tenant(tpm=600)
    ticket = admit_now(ctrl, acme, prompt_tokens=0, output_tokens=100)
    ticket.charge_output_tokens(80)
    ticket.charge_output_tokens(70)  # 50 beyond the reservation: billed now
    ticket.release()  # nothing left to give back
    assert rejection(ctrl, acme, prompt_tokens=451, output_tokens=0).retry_after == pytest.approx(0.1)


def test_a_reservation_larger_than_the_limit_is_too_large_without_retry():
    # The case: n=16 x max_tokens=400 against a 2,000 tokens/min tenant.
    err = rejection(AdmissionController(FakeClock()), tenant(tpm=2000), prompt_tokens=5,
                    output_tokens=16 * 400)
    assert err.reason == "tokens_per_minute" and err.retry_after is None
    assert "Request too large" in err.message and "Limit 2000" in err.message and "Requested 6405" in err.message


def test_a_queued_reservation_is_refunded_when_the_request_never_runs():
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        acme = tenant(tpm=100)
        ctrl.set_capacity(0)
        task = asyncio.create_task(ctrl.admit(acme, STANDARD, 10, 90))
        await settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ctrl.set_capacity(1)
        (await ctrl.admit(acme, STANDARD, 10, 90)).release()  # all 100 tokens were given back
    asyncio.run(scenario())


def test_prompt_larger_than_the_whole_bucket_cannot_be_retried():
    ctrl = AdmissionController(FakeClock())
    err = rejection(ctrl, tenant(tpm=600), prompt_tokens=601)
    assert err.reason == "tokens_per_minute" and err.retry_after is None
    assert "601" in err.message and "600" in err.message


def test_concurrency_limit_and_idempotent_release():
    ctrl = AdmissionController(FakeClock())
    acme = tenant(concurrent=2)
    first, second = admit_now(ctrl, acme), admit_now(ctrl, acme)
    err = rejection(ctrl, acme)
    assert err.reason == "concurrency" and err.retry_after == RETRY_HINT_S and "2" in err.message
    first.release()
    first.release()  # a second release must not free a second slot
    third = admit_now(ctrl, acme)
    assert rejection(ctrl, acme).reason == "concurrency"
    with second:
        pass  # the context manager releases
    with third:
        assert ctrl.in_flight("acme") == 1
    assert ctrl.in_flight("acme") == 0


def test_queued_requests_count_toward_concurrency():
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        acme = tenant(concurrent=2)
        ctrl.set_capacity(1)
        running = await ctrl.admit(acme, STANDARD, 1)
        waiting = asyncio.create_task(ctrl.admit(acme, STANDARD, 1))
        await settle()
        assert ctrl.queue_len == 1
        with pytest.raises(Rejected) as info:
            await ctrl.admit(acme, STANDARD, 1)
        assert info.value.reason == "concurrency"
        running.release()
        (await waiting).release()
    asyncio.run(scenario())


def test_a_rejection_consumes_no_other_limit():
    ctrl = AdmissionController(FakeClock())
    # Rejected for concurrency: neither bucket may be charged.
    acme = tenant(rpm=2, tpm=100, concurrent=1)
    first = admit_now(ctrl, acme, prompt_tokens=50)
    assert rejection(ctrl, acme, prompt_tokens=50).reason == "concurrency"
    first.release()
    admit_now(ctrl, acme, prompt_tokens=50)  # needs the last request and the last 50 tokens
    # Rejected for tokens: the request count is not charged.
    beta = tenant("beta", rpm=2, tpm=100)
    admit_now(ctrl, beta, prompt_tokens=80)
    assert rejection(ctrl, beta, prompt_tokens=50).reason == "tokens_per_minute"
    admit_now(ctrl, beta, prompt_tokens=20)
    assert rejection(ctrl, beta, prompt_tokens=0).reason == "requests_per_minute"


def test_several_failing_limits_report_the_longest_wait():
    ctrl = AdmissionController(FakeClock())
    acme = tenant(rpm=1, tpm=120)  # 1/60 requests/s, 2 tokens/s
    admit_now(ctrl, acme, prompt_tokens=100)
    err = rejection(ctrl, acme, prompt_tokens=60)  # tokens: 40 short -> 20 s; requests: 60 s
    assert err.reason == "requests_per_minute" and err.retry_after == pytest.approx(60.0)


def test_reloaded_limits_take_effect():
    ctrl = AdmissionController(FakeClock())
    admit_now(ctrl, tenant(rpm=1))
    assert rejection(ctrl, tenant(rpm=1)).reason == "requests_per_minute"
    admit_now(ctrl, tenant(rpm=10))  # same tenant, new limits from a reloaded file


# ---- capacity, shedding and the queue ---------------------------------------

def test_budget_unlimited_until_first_report_then_counted():
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        acme = tenant()
        for _ in range(100):
            await ctrl.admit(acme, STANDARD, 1)  # no stats yet: never saturated
        ctrl.set_capacity(2)
        a = await ctrl.admit(acme, STANDARD, 1)
        b = await ctrl.admit(acme, STANDARD, 1)
        assert ctrl.saturated and ctrl.free_slots == 0
        c = asyncio.create_task(ctrl.admit(acme, STANDARD, 1))
        await settle()
        assert not c.done() and ctrl.queue_len == 1
        a.release()  # frees a slot before the next report: c goes
        await settle()
        assert c.done() and ctrl.free_slots == 0
        a.release()  # idempotent: no phantom slot
        assert ctrl.free_slots == 0
        b.release()
        assert ctrl.free_slots == 1
        ctrl.set_capacity(0)  # a fresh report overrides the running count
        d = asyncio.create_task(ctrl.admit(acme, STANDARD, 1))
        await settle()
        c.result().release()
        await settle()
        assert d.done() and ctrl.free_slots == 0
    asyncio.run(scenario())


def test_only_sheddable_classes_are_shed_under_saturation():
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        acme = tenant(rpm=2)
        (await ctrl.admit(acme, BATCH, 1)).release()  # not saturated: batch is fine
        ctrl.set_capacity(0)
        with pytest.raises(Rejected) as info:
            await ctrl.admit(acme, BATCH, 1)
        assert info.value.reason == "shed" and info.value.retry_after == RETRY_HINT_S
        assert "batch" in info.value.message
        standard = asyncio.create_task(ctrl.admit(acme, STANDARD, 1))
        await settle()
        assert ctrl.queue_len_by_class() == {"standard": 1}
        ctrl.set_capacity(1)
        (await standard).release()
        # The shed request charged nothing: two requests/min were admitted and now none are left.
        with pytest.raises(Rejected, match="requests_per_minute"):
            await ctrl.admit(acme, STANDARD, 1)
    asyncio.run(scenario())


def test_queue_full_rejects_without_charging():
    async def scenario():
        ctrl = AdmissionController(FakeClock(), max_queue_len=2)
        ctrl.set_capacity(0)
        waiting = [asyncio.create_task(ctrl.admit(tenant(f"t{i}"), STANDARD, 1)) for i in range(2)]
        await settle()
        acme = tenant(rpm=1)
        with pytest.raises(Rejected) as info:
            await ctrl.admit(acme, STANDARD, 1)
        assert info.value.reason == "queue_full" and "2" in info.value.message
        assert ctrl.queue_len == 2 and ctrl.in_flight("acme") == 0
        ctrl.set_capacity(3)
        await asyncio.gather(*waiting)
        await ctrl.admit(acme, STANDARD, 1)  # its one request/min is still there
    asyncio.run(scenario())


def test_queue_timeout_refunds_everything():
    async def scenario():
        clock = FakeClock()
        ctrl = AdmissionController(clock, queue_timeout_s=0.02)
        acme = tenant(rpm=1, tpm=100, concurrent=1)
        ctrl.set_capacity(0)
        with pytest.raises(Rejected) as info:
            await ctrl.admit(acme, STANDARD, 100)
        assert info.value.reason == "queue_timeout" and info.value.retry_after == RETRY_HINT_S
        assert ctrl.queue_len == 0 and ctrl.in_flight("acme") == 0
        ctrl.set_capacity(1)
        ticket = await ctrl.admit(acme, STANDARD, 100)  # request, tokens and slot were all given back
        assert ticket.queue_wait_s == 0.0
    asyncio.run(scenario())


def test_dispatched_ticket_reports_queue_wait_on_the_injected_clock():
    async def scenario():
        clock = FakeClock()
        ctrl = AdmissionController(clock)
        ctrl.set_capacity(0)
        task = asyncio.create_task(ctrl.admit(tenant(), STANDARD, 1))
        await settle()
        clock.advance(2.5)
        ctrl.set_capacity(1)
        assert (await task).queue_wait_s == pytest.approx(2.5)
    asyncio.run(scenario())


def test_cancel_while_queued_cleans_up():
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        acme = tenant(rpm=1, concurrent=1)
        ctrl.set_capacity(0)
        task = asyncio.create_task(ctrl.admit(acme, STANDARD, 1))
        await settle()
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ctrl.queue_len == 0 and ctrl.queue_len_by_class() == {} and ctrl.in_flight("acme") == 0
        ctrl.set_capacity(1)
        assert ctrl.free_slots == 1  # nothing was dispatched to the dead request
        (await ctrl.admit(acme, STANDARD, 1)).release()  # its request/min was refunded
    asyncio.run(scenario())


def test_cancel_after_dispatch_but_before_resuming_releases_the_slot():
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        acme = tenant(concurrent=1)
        ctrl.set_capacity(0)
        task = asyncio.create_task(ctrl.admit(acme, STANDARD, 1))
        await settle()
        ctrl.set_capacity(1)  # dispatched: the ticket is on its way
        task.cancel()  # ... and the client leaves before the task resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ctrl.free_slots == 1 and ctrl.in_flight("acme") == 0
    asyncio.run(scenario())


def test_cancelled_waiter_is_skipped_by_a_racing_dispatch():
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        ctrl.set_capacity(0)
        first = asyncio.create_task(ctrl.admit(tenant("a"), STANDARD, 1))
        second = asyncio.create_task(ctrl.admit(tenant("b"), STANDARD, 1))
        await settle()
        first.cancel()
        ctrl.set_capacity(1)  # before `first` ran its cleanup: the slot goes to `second`
        await settle()
        assert first.cancelled() and second.done() and ctrl.free_slots == 0
        assert ctrl.in_flight("a") == 0 and ctrl.queue_len == 0
    asyncio.run(scenario())


# ---- fair order ------------------------------------------------------------

def _queue_up(ctrl, entries):
    """Start one admit task per (label, tenant name, class); record resume order."""
    order: list[str] = []

    async def one(label, name, pclass):
        ticket = await ctrl.admit(tenant(name), pclass, 1)
        order.append(label)
        return ticket
    return order, [asyncio.create_task(one(*entry)) for entry in entries]


def test_weighted_fair_order_across_classes_through_the_controller():
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        ctrl.set_capacity(0)
        entries = [("low", f"l{i % 3}", LOW) for i in range(50)] + [("high", f"h{i % 3}", HIGH) for i in range(50)]
        order, tasks = _queue_up(ctrl, entries)
        await settle()
        assert ctrl.queue_len_by_class() == {"low": 50, "high": 50}
        ctrl.set_capacity(50)
        await settle()
        counts = Counter(order)
        assert abs(counts["high"] - 40) <= 1 and abs(counts["low"] - 10) <= 1
        assert ctrl.queue_len == 50
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert ctrl.queue_len == 0
    asyncio.run(scenario())


def test_weighted_order_interleaves_and_idle_classes_bank_no_credit():
    queue = FairQueue()
    for i in range(200):
        queue.push(("a", i), class_name="a", weight=4, rank=0, tenant="t")
    queue.push(("b", -1), class_name="b", weight=1, rank=1, tenant="t")
    first = [queue.pop()[0] for _ in range(5)]
    assert sorted(first) == ["a", "a", "a", "a", "b"]
    assert [queue.pop()[0] for _ in range(40)] == ["a"] * 40
    # "b" was idle while "a" ran 40 dispatches: it rejoins at the current
    # virtual time instead of claiming 8 dispatches of back pay.
    for i in range(50):
        queue.push(("b", i), class_name="b", weight=1, rank=1, tenant="t")
    window = [queue.pop()[0] for _ in range(50)]
    assert abs(window.count("b") - 10) <= 1
    # And the share is spread out, not bunched: every 5 dispatches hold one "b" (+-1).
    for start in range(0, 50, 5):
        assert 0 <= window[start:start + 5].count("b") <= 2


def test_round_robin_across_tenants_fifo_within_a_tenant():
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        ctrl.set_capacity(0)
        entries = [(f"big-{i}", "big", STANDARD) for i in range(100)] + [("small-0", "small", STANDARD)]
        order, tasks = _queue_up(ctrl, entries)
        await settle()
        ctrl.set_capacity(3)
        await settle()
        # The tenant with one request waits one turn, not 100.
        assert order == ["big-0", "small-0", "big-1"]
        ctrl.set_capacity(100)
        await settle()
        assert order[3:] == [f"big-{i}" for i in range(2, 100)]
        await asyncio.gather(*tasks)
    asyncio.run(scenario())


def test_fair_queue_remove_and_lengths():
    queue = FairQueue()
    items = [object() for _ in range(3)]
    for item in items:
        queue.push(item, class_name="c", weight=1, rank=0, tenant="t")
    assert queue.remove(items[1], class_name="c", tenant="t")
    assert not queue.remove(items[1], class_name="c", tenant="t")
    assert not queue.remove(items[0], class_name="other", tenant="t")
    assert len(queue) == 2 and queue.len_by_class() == {"c": 2}
    assert [queue.pop(), queue.pop()] == [items[0], items[2]]
    with pytest.raises(IndexError):
        queue.pop()
