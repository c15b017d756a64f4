"""Background requests (SchedulerConfig.background_priority): batch work that
runs only on what interactive requests leave idle, and steps aside for them."""

from __future__ import annotations

import random

import pytest

from engine_pod.config import SchedulerConfig
from engine_pod.request import RequestStatus
from tests.engine_pod.core.scheduler_helpers import assert_no_leak, make_req, make_sched, run_to_end, step

BG = 20  # the background threshold in these tests


def bg_sched(**cfg):
    cfg = {"policy": "priority", "background_priority": BG, **cfg}
    return make_sched(**cfg)


def tokens_of(out, rids):
    return sum(n for rid, n in out.num_scheduled_tokens.items() if rid in rids)


def test_background_takes_nothing_while_a_foreground_prompt_prefills():
    sched = bg_sched(max_num_batched_tokens=8, num_blocks=64)
    batch = make_req("batch", 3, max_tokens=30, priority=BG, arrival=0.0)
    sched.add_request(batch)
    step(sched)  # the batch line's prefill: it decodes from now on
    assert step(sched)[0].num_scheduled_tokens == {"batch": 1}
    chat = make_req("chat", 20, max_tokens=3, priority=10, arrival=1.0)
    sched.add_request(chat)
    # 20 prompt tokens at 8 a step: three steps of the chat prompt alone.
    for expected in (8, 8, 4):
        out, _ = step(sched)
        assert out.num_scheduled_tokens == {"chat": expected}
    out, _ = step(sched)  # the chat request decodes: the batch line shares the step again
    assert out.num_scheduled_tokens == {"chat": 1, "batch": 1}
    run_to_end(sched)
    assert_no_leak(sched)


def test_background_yields_the_step_a_foreground_request_is_admitted():
    sched = bg_sched(max_num_batched_tokens=64)
    sched.add_request(make_req("batch", 3, max_tokens=10, priority=BG))
    step(sched)
    sched.add_request(make_req("chat", 5, max_tokens=2, priority=0, arrival=1.0))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"chat": 5}


def test_background_tokens_per_step_are_capped_all_together():
    sched = bg_sched(max_num_batched_tokens=64, background_max_batched_tokens=10, num_blocks=256)
    for i in range(4):
        sched.add_request(make_req(f"b{i}", 12, max_tokens=2, priority=BG + i, arrival=float(i)))
    seen = []
    run_to_end(sched, check=lambda s, out: seen.append(sum(out.num_scheduled_tokens.values())))
    assert max(seen) == 10 and all(n <= 10 for n in seen)
    assert_no_leak(sched)


def test_without_foreground_work_background_runs_at_its_cap():
    # Idle capacity is used: with no other request the batch line's prompt goes at the cap per step.
    sched = bg_sched(max_num_batched_tokens=64, background_max_batched_tokens=16)
    sched.add_request(make_req("batch", 40, max_tokens=1, priority=BG))
    assert [step(sched)[0].num_scheduled_tokens["batch"] for _ in range(3)] == [16, 16, 8]


def test_a_foreground_request_preempts_background_for_a_sequence_slot():
    sched = bg_sched(max_num_seqs=1, max_num_batched_tokens=64)
    batch = make_req("batch", 3, max_tokens=6, priority=BG)
    sched.add_request(batch)
    step(sched)
    step(sched)
    sched.add_request(make_req("chat", 4, max_tokens=2, priority=10, arrival=1.0))
    out, _ = step(sched)
    assert out.preempted_req_ids == {"batch"} and out.num_scheduled_tokens == {"chat": 4}
    assert batch.status == RequestStatus.PREEMPTED and batch.num_computed_tokens == 0
    finished = run_to_end(sched)
    assert set(finished) == {"chat", "batch"}
    assert len(batch.output_token_ids) == 6  # recomputed, then ran to its end
    assert_no_leak(sched)


def test_a_foreground_request_preempts_background_for_kv_blocks():
    # 4 blocks of 4 slots: the batch line holds 3; the chat prompt needs 2.
    sched = bg_sched(num_blocks=4, max_num_batched_tokens=64)
    sched.add_request(make_req("batch", 10, max_tokens=5, priority=BG))
    step(sched)
    sched.add_request(make_req("chat", 6, max_tokens=2, priority=10, arrival=1.0))
    out, _ = step(sched)
    assert out.preempted_req_ids == {"batch"} and out.num_scheduled_tokens == {"chat": 6}
    run_to_end(sched)
    assert_no_leak(sched)


def test_background_never_preempts_background():
    sched = bg_sched(max_num_seqs=1, max_num_batched_tokens=64)
    sched.add_request(make_req("b0", 3, max_tokens=4, priority=BG))
    step(sched)
    sched.add_request(make_req("b1", 3, max_tokens=4, priority=BG - 0 + 5, arrival=1.0))
    sched.add_request(make_req("b2", 3, max_tokens=4, priority=BG, arrival=2.0))
    out, _ = step(sched)
    assert not out.preempted_req_ids and out.num_scheduled_tokens == {"b0": 1}


def test_foreground_requests_are_unaffected_without_a_threshold():
    # The same requests with and without background_priority set far above
    # their priorities: identical schedules.
    def schedules(**cfg):
        sched = make_sched(policy="priority", max_num_batched_tokens=16, **cfg)
        for i in range(5):
            sched.add_request(make_req(f"r{i}", 7 + 3 * i, max_tokens=5, priority=i % 3, arrival=float(i)))
        seen = []
        run_to_end(sched, check=lambda s, out: seen.append(dict(out.num_scheduled_tokens)))
        return seen

    assert schedules() == schedules(background_priority=100)


@pytest.mark.parametrize("seed", range(4))
def test_random_mixed_load_keeps_the_background_rules(seed):
    rng = random.Random(seed)
    cap = 12
    sched = bg_sched(num_blocks=48, max_num_seqs=6, max_num_batched_tokens=32, background_max_batched_tokens=cap)
    arrivals = sorted((rng.randrange(60), i) for i in range(30))
    background = set()
    for t in range(2000):
        for _, i in [a for a in arrivals if a[0] == t]:
            priority = rng.choice([0, 10, BG, BG + 5])
            rid = f"r{i}"
            if priority >= BG:
                background.add(rid)
            sched.add_request(make_req(rid, rng.randrange(1, 40), max_tokens=rng.randrange(1, 12),
                                       priority=priority, arrival=float(t)))
        if t > 60 and not sched.has_unfinished_requests():
            break
        fg_busy = any(r.request_id not in background for r in sched.waiting) or any(
            r.request_id not in background and r.num_tokens - r.num_computed_tokens > 1 for r in sched.running)
        out, _ = step(sched)
        bg_tokens = tokens_of(out, background)
        assert bg_tokens <= cap
        if fg_busy:
            assert bg_tokens == 0, f"step {t}: background ran while foreground work was pending"
        preempted_fg = out.preempted_req_ids - background
        # Foreground is only preempted by running out of blocks for running requests, never for a
        # background one: no step preempts foreground while background still holds blocks.
        if preempted_fg:
            assert not any(r.request_id in background for r in sched.running)
    assert not sched.has_unfinished_requests()
    assert_no_leak(sched)


def test_the_load_the_gateway_sees_leaves_background_requests_out():
    sched = bg_sched(max_num_batched_tokens=8, max_num_seqs=1)
    sched.add_request(make_req("chat", 6, max_tokens=4, priority=10))
    sched.add_request(make_req("batch", 30, max_tokens=4, priority=BG, arrival=1.0))
    sched.add_request(make_req("other-chat", 5, max_tokens=4, priority=0, arrival=2.0))
    assert (sched.num_waiting, sched.num_waiting_foreground()) == (3, 2)
    stats = sched.make_stats()
    assert (stats.num_waiting_reqs, stats.num_background_waiting, stats.num_background_running) == (3, 1, 0)
    assert sched.num_pending_prefill_tokens() == 5 + 4  # the chat prompts, less the token each decodes first
    plain = make_sched(policy="priority")
    plain.add_request(make_req("batch", 30, max_tokens=4, priority=BG))
    assert (plain.num_waiting_foreground(), plain.num_pending_prefill_tokens()) == (1, 29)


def test_blocks_only_background_requests_hold_count_as_free_to_the_gateway():
    sched = bg_sched(num_blocks=10, max_num_batched_tokens=64)
    sched.add_request(make_req("batch", 12, max_tokens=4, priority=BG))  # 3 blocks of 4
    sched.add_request(make_req("chat", 8, max_tokens=4, priority=10, arrival=1.0))  # 2 blocks
    step(sched)  # the chat prompt alone (the batch line yields)
    step(sched)  # the chat decodes: the batch line's prompt runs beside it
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_usage() == pytest.approx(6 / 10)  # 3 + 3 (the chat's 9th token opened a third block)
    assert sched.kv_cache_usage_foreground() == pytest.approx(3 / 10)
    assert (sched.make_stats().num_running_reqs, sched.make_stats().num_background_running) == (2, 1)
    plain = make_sched(num_blocks=10, policy="priority")
    plain.add_request(make_req("batch", 12, max_tokens=4, priority=BG))
    step(plain)
    assert plain.kv_cache_usage_foreground() == plain.kv_cache_manager.block_pool.get_usage() == pytest.approx(0.3)


@pytest.mark.parametrize("cfg, message", [
    ({"background_priority": 5}, "needs scheduling_policy 'priority'"),
    ({"background_priority": True, "policy": "priority"}, "background_priority must be an integer"),
    ({"background_priority": 2**31, "policy": "priority"}, "background_priority must be an integer"),
    ({"background_max_batched_tokens": 0}, "background_max_batched_tokens must be a positive integer"),
])
def test_bad_background_settings_are_refused(cfg, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**cfg)
