"""Admission's capacity budget, shedding, the queue's limits and cleanup,
and the fair dispatch order (weighted across classes, round robin across
tenants)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.admission import RETRY_HINT_S, AdmissionController, FairQueue, Rejected
from tests.fake_clock import FakeClock
from tests.gateway.admission_fakes import BATCH, HIGH, LOW, STANDARD, settle, tenant


# ---- capacity, shedding and the queue ---------------------------------------

def test_budget_unlimited_until_first_report_then_counted():
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        acme = tenant()
        for _ in range(100):
            (await ctrl.admit(acme, STANDARD, 1)).placed()  # no stats yet: never saturated
        ctrl.set_capacity(2)
        a = await ctrl.admit(acme, STANDARD, 1)
        b = await ctrl.admit(acme, STANDARD, 1)
        a.placed()
        b.placed()
        assert ctrl.saturated and ctrl.free_slots == 0
        c = asyncio.create_task(ctrl.admit(acme, STANDARD, 1))
        await settle()
        assert not c.done() and ctrl.queue_len == 1
        a.release()  # frees a slot before the next report: c goes
        await settle()
        assert c.done() and ctrl.free_slots == 0
        c.result().placed()
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


def test_admitted_but_not_yet_sent_to_a_pod_keeps_its_slot_across_reports():
    """A report that arrives while an admitted request is still being routed
    does not count it: the slot stays spent until the request is placed, or
    every refresh would let more through (the pods took a dozen lows past
    max_waiting_per_pod this way while routing was slow)."""
    async def scenario():
        ctrl = AdmissionController(FakeClock())
        acme = tenant()
        ctrl.set_capacity(2)
        a = await ctrl.admit(acme, STANDARD, 1)
        b = await ctrl.admit(acme, STANDARD, 1)
        ctrl.set_capacity(2)  # the pods have not seen a or b yet
        assert ctrl.saturated and ctrl.free_slots == 0
        a.placed()
        a.placed()  # idempotent
        ctrl.set_capacity(1)  # the pod counts a now
        assert ctrl.free_slots == 0
        b.release()  # failed before it reached a pod: nothing pending
        b.placed()
        ctrl.set_capacity(2)
        assert ctrl.free_slots == 2
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
        ticket.placed()  # sent to a pod: the pods' reports count it from now on
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
