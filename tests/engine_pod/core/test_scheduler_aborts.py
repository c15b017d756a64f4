"""The scheduler's aborts and block accounting: aborted, finished and
preempted requests free every block, and a step's cost does not grow with
the pool."""

from __future__ import annotations

import gc

from engine_pod.core.scheduler_output import ModelRunnerOutput
from engine_pod.request import RequestStatus
from tests.engine_pod.core.scheduler_helpers import (
    BS,
    SAMPLED,
    assert_no_leak,
    make_req,
    make_sched,
    run_to_end,
    run_until_preemption,
    step,
)


# -- aborts and leaks -------------------------------------------------------------


def test_finish_requests_aborts_waiting_and_running():
    sched = make_sched(max_num_seqs=1)
    run = make_req("run", 10, max_tokens=10, arrival=0.0)
    wait = make_req("wait", 10, max_tokens=10, arrival=1.0)
    sched.add_request(run)
    sched.add_request(wait)
    step(sched)
    assert run.status == RequestStatus.RUNNING and wait.status == RequestStatus.WAITING
    assert sched.kv_cache_manager.req_to_blocks["run"]
    done = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in done} == {"run", "wait"}
    assert run.status.finish_reason == "abort" and wait.status.finish_reason == "abort"
    assert sched.finish_requests(["run"], RequestStatus.FINISHED_ABORTED) == []  # already gone
    assert sched.running == [] and len(sched.waiting) == 0
    out = sched.schedule()
    assert out.finished_req_ids == {"run", "wait"}
    assert out.is_empty
    assert sched.schedule().finished_req_ids == set()  # reported once
    assert_no_leak(sched)


def test_abort_mid_prefill_and_preempted():
    sched = make_sched(num_blocks=6, max_num_batched_tokens=64, max_num_seqs=2)
    a = make_req("a", 8, max_tokens=10, arrival=0.0)
    b = make_req("b", 8, max_tokens=10, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    run_until_preemption(sched)
    assert b.status == RequestStatus.PREEMPTED
    sched.finish_requests(["b", "a"], RequestStatus.FINISHED_ABORTED)
    assert_no_leak(sched)

    sched = make_sched(max_num_batched_tokens=8)
    c = make_req("c", 30)
    sched.add_request(c)
    step(sched)
    assert 0 < c.num_computed_tokens < c.num_tokens
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert_no_leak(sched)


def test_abort_between_schedule_and_update_is_ignored():
    sched = make_sched()
    r = make_req("r", 4)
    sched.add_request(r)
    out = sched.schedule()
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    results = sched.update_from_output(out, ModelRunnerOutput({"r": [SAMPLED]}))
    assert results == []
    assert r.output_token_ids == []
    assert_no_leak(sched)


def test_finished_ids_reach_the_next_output():
    sched = make_sched()
    sched.add_request(make_req("r", 4, max_tokens=1))
    _, res = step(sched)
    assert res["r"].finished
    assert sched.schedule().finished_req_ids == {"r"}


def _mixed_workload(sched, n=12):
    shared = list(range(5000, 5012))
    for i in range(n):
        prefix = shared if i % 3 == 0 else ()  # a third share a 3-block prefix
        sched.add_request(
            make_req(f"m{i}", 3 + (7 * i) % 23, max_tokens=1 + (5 * i) % 9, arrival=float(i), prefix=prefix)
        )


def test_no_block_leak_after_mixed_workload_with_preemption():
    sched = make_sched(num_blocks=14, max_num_batched_tokens=24, max_num_seqs=6)
    _mixed_workload(sched, n=16)
    preemptions = []
    run_to_end(sched, check=lambda s, out: preemptions.extend(out.preempted_req_ids))
    assert preemptions  # the pool was tight enough to preempt
    assert_no_leak(sched)


def test_kv_waste_below_block_size_per_running_request():
    sched = make_sched(num_blocks=14, max_num_batched_tokens=24, max_num_seqs=6, long_prefill_token_threshold=10)
    _mixed_workload(sched, n=16)
    seen_running = []

    def check(s, out):
        stats = s.make_stats()
        kv = s.kv_cache_manager
        for r in s.running:
            waste = kv.num_allocated_slots(r.request_id) - r.num_computed_tokens
            assert 0 <= waste < BS, (r.request_id, waste)
        assert stats.num_running_reqs == len(s.running)
        assert stats.kv_waste_slots <= (BS - 1) * stats.num_running_reqs
        seen_running.append(stats.num_running_reqs)

    run_to_end(sched, check=check)
    assert max(seen_running) > 1
    assert_no_leak(sched)


# -- cost independent of pool size -------------------------------------------------


def _count_block_ops(num_blocks):
    gc.disable()  # building a million blocks is 3x faster without the cyclic GC
    try:
        sched = make_sched(num_blocks=num_blocks, max_num_batched_tokens=32, max_num_seqs=4)
    finally:
        gc.enable()
    queue = sched.kv_cache_manager.block_pool.free_block_queue
    counts = {"popleft": 0, "remove": 0, "append": 0, "get_all_free_blocks": 0}
    counting = [False]

    def counted(name):
        orig = getattr(queue, name)

        def wrapper(*args):
            if counting[0]:
                counts[name] += 1
            return orig(*args)

        return wrapper

    for name in counts:
        setattr(queue, name, counted(name))

    _mixed_workload(sched, n=12)
    schedules = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        counting[0] = True
        out = sched.schedule()
        counting[0] = False
        schedules.append(out.num_scheduled_tokens)
        sampled = {
            rid: [SAMPLED]
            for rid in out.num_scheduled_tokens
            if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens
        }
        sched.update_from_output(out, ModelRunnerOutput(sampled))
    assert_no_leak(sched)
    return counts, schedules


def test_schedule_cost_does_not_depend_on_pool_size():
    small_counts, small_schedules = _count_block_ops(1_000)
    big_counts, big_schedules = _count_block_ops(1_000_000)
    assert small_schedules == big_schedules
    assert small_counts["popleft"] > 0  # allocations
    assert small_counts["remove"] > small_counts["popleft"]  # popleft removes, plus prefix-hit revivals
    assert small_counts == big_counts
