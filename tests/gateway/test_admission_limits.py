"""Admission's per-tenant limits on a fake clock: the token bucket, requests
and tokens per minute (reservations, refunds, billing as output streams),
concurrency, and how failing limits are reported."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission import RETRY_HINT_S, AdmissionController, Rejected, TokenBucket
from tests.fake_clock import FakeClock
from tests.gateway.admission_fakes import STANDARD, admit_now, rejection, settle, tenant


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
