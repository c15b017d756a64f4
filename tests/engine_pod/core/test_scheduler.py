"""The token-budget scheduler, driven without a model
(tests/engine_pod/core/scheduler_helpers.py): the budget, the order of
admission, chunked prefill and preemption."""

from __future__ import annotations

from engine_pod.core.scheduler_output import CachedRequestData
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


# -- budget and order -------------------------------------------------------------


def test_token_budget_and_running_before_waiting():
    sched = make_sched(max_num_batched_tokens=16)
    for i, rid in enumerate("abc"):
        sched.add_request(make_req(rid, 10, max_tokens=5, arrival=float(i)))

    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}  # b chunked by the budget
    out, _ = step(sched)
    # The running a (decode) and b (rest of prompt) come first, then c.
    assert out.num_scheduled_tokens == {"a": 1, "b": 4, "c": 10}

    def check(s, out):
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= 16
        new_ids = [n.req_id for n in out.scheduled_new_reqs]
        order = list(out.num_scheduled_tokens)
        # Every newly admitted request comes after every running one.
        assert order[len(order) - len(new_ids):] == new_ids

    finished = run_to_end(sched, check=check)
    assert set(finished) == {"a", "b", "c"}
    assert_no_leak(sched)


def test_waiting_not_admitted_while_running_use_whole_budget():
    sched = make_sched(max_num_batched_tokens=8)
    sched.add_request(make_req("long", 20, arrival=0.0))
    sched.add_request(make_req("next", 2, arrival=1.0))
    for _ in range(2):
        out, _ = step(sched)
        assert out.num_scheduled_tokens == {"long": 8}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 4, "next": 2}


def test_chunked_prefill_samples_only_on_last_chunk():
    sched = make_sched(max_num_batched_tokens=8)
    req = make_req("p", 20, max_tokens=2)
    sched.add_request(req)
    chunks = []
    for expected_computed in (8, 16):
        out, res = step(sched)
        chunks.append(out.num_scheduled_tokens["p"])
        assert req.num_computed_tokens == expected_computed
        assert res == {}
        assert req.output_token_ids == []
    out, res = step(sched)
    chunks.append(out.num_scheduled_tokens["p"])
    assert chunks == [8, 8, 4]
    # Later chunks reach the runner as updates of a request it already holds.
    assert out.scheduled_new_reqs == []
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["p"]
    assert res["p"].new_token_ids == [SAMPLED]
    assert req.output_token_ids == [SAMPLED]
    assert req.status == RequestStatus.RUNNING
    out, res = step(sched)
    assert out.num_scheduled_tokens == {"p": 1}
    assert res["p"].finish_reason == "length"
    assert_no_leak(sched)


def test_long_prefill_token_threshold_caps_a_chunk():
    sched = make_sched(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    sched.add_request(make_req("a", 12, max_tokens=2, arrival=0.0))
    sched.add_request(make_req("b", 7, max_tokens=2, arrival=1.0))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 5, "b": 5}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 5, "b": 2}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 2, "b": 1}  # b decodes
    run_to_end(sched)
    assert_no_leak(sched)


def test_max_num_seqs_caps_running_requests():
    sched = make_sched(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_req(f"r{i}", 3, max_tokens=3, arrival=float(i)))
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(sched.running) == 2 and len(sched.waiting) == 3

    def check(s, out):
        assert len(s.running) <= 2
        assert len(out.num_scheduled_tokens) <= 2

    finished = run_to_end(sched, check=check)
    assert set(finished) == {f"r{i}" for i in range(5)}
    assert_no_leak(sched)


# -- preemption -------------------------------------------------------------------


def test_fcfs_preempts_latest_arrival_and_it_resumes():
    # 6 blocks of 4: two requests of 8 prompt + 10 output tokens cannot both fit.
    sched = make_sched(num_blocks=6, max_num_seqs=2)
    a = make_req("a", 8, max_tokens=10, arrival=0.0)
    b = make_req("b", 8, max_tokens=10, arrival=1.0)
    c = make_req("c", 4, max_tokens=2, arrival=2.0)  # waits behind max_num_seqs
    for r in (a, b, c):
        sched.add_request(r)
    out, _ = run_until_preemption(sched)
    assert out.preempted_req_ids == {"b"}
    assert "b" not in out.num_scheduled_tokens
    assert "a" in out.num_scheduled_tokens
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert "b" not in sched.kv_cache_manager.req_to_blocks
    assert sched.running == [a]
    assert list(sched.waiting) == [b, c]  # back at the front of the queue
    assert sched.make_stats().num_preemptions == 1
    outputs_before = list(b.output_token_ids)
    assert outputs_before  # it had decoded before being preempted

    finished = run_to_end(sched)
    assert set(finished) == {"a", "b", "c"}
    assert finished["b"].finish_reason == "length"
    assert b.output_token_ids[: len(outputs_before)] == outputs_before
    assert b.num_output_tokens == 10
    assert_no_leak(sched)


def test_resumed_request_is_cached_request_data_with_flag():
    sched = make_sched(num_blocks=6, max_num_seqs=2)
    a = make_req("a", 8, max_tokens=10, arrival=0.0)
    b = make_req("b", 8, max_tokens=10, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    run_until_preemption(sched)
    for _ in range(50):
        out, _ = step(sched)
        if "b" in out.num_scheduled_tokens:
            break
    else:
        raise AssertionError("b never resumed")
    assert all(n.req_id != "b" for n in out.scheduled_new_reqs)
    (data,) = [c for c in out.scheduled_cached_reqs if c.req_id == "b"]
    assert isinstance(data, CachedRequestData)
    assert data.resumed_from_preemption is True
    # A fresh block table for the whole recomputation.
    assert data.new_block_ids == sched.kv_cache_manager.get_block_ids("b")
    assert len(data.new_block_ids) * BS >= b.num_computed_tokens
    # Ordinary running updates are not flagged.
    assert all(not c.resumed_from_preemption for c in out.scheduled_cached_reqs if c.req_id != "b")


def _three_running(policy):
    # Pool of 3 blocks; each request holds one. Only x needs a new block next step.
    sched = make_sched(num_blocks=3, policy=policy)
    x = make_req("x", 4, max_tokens=2, priority=0, arrival=0.0)
    y = make_req("y", 3, max_tokens=2, priority=5, arrival=1.0)
    z = make_req("z", 3, max_tokens=2, priority=1, arrival=2.0)
    for r in (x, y, z):
        sched.add_request(r)
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"x", "y", "z"}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    return sched, x, y, z


def test_fcfs_victim_is_latest_arrival():
    sched, x, y, z = _three_running("fcfs")
    out, _ = step(sched)
    assert out.preempted_req_ids == {"z"}
    assert z.status == RequestStatus.PREEMPTED


def test_priority_victim_is_lowest_priority():
    sched, x, y, z = _three_running("priority")
    out, _ = step(sched)
    assert out.preempted_req_ids == {"y"}  # priority 5, though z arrived later
    assert y.status == RequestStatus.PREEMPTED
    assert "z" in out.num_scheduled_tokens and z.num_preemptions == 0
    run_to_end(sched)
    assert_no_leak(sched)


def test_priority_victim_ties_broken_by_latest_arrival():
    sched = make_sched(num_blocks=3, policy="priority")
    x = make_req("x", 4, priority=0, arrival=0.0)
    y = make_req("y", 3, priority=1, arrival=1.0)
    z = make_req("z", 3, priority=1, arrival=2.0)
    for r in (x, y, z):
        sched.add_request(r)
    step(sched)
    out, _ = step(sched)
    assert out.preempted_req_ids == {"z"}


def test_self_preemption_does_not_starve_the_rest_of_running():
    # Priority policy: b (priority 1) runs first, a (priority 0) is admitted
    # after it, so running == [b, a]. b then needs a block, the pool is full,
    # and b itself is the victim. a needs no new block and should still run.
    sched = make_sched(num_blocks=3, policy="priority")
    b = make_req("b", 7, max_tokens=8, priority=1, arrival=0.0)
    a = make_req("a", 3, max_tokens=8, priority=0, arrival=1.0)
    sched.add_request(b)
    step(sched)
    sched.add_request(a)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"b": 1, "a": 3}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    out, _ = step(sched)
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}


def test_priority_admission_order():
    sched = make_sched(policy="priority", max_num_seqs=1)
    specs = [("p2", 2, 0.0), ("p0a", 0, 1.0), ("p1", 1, 2.0), ("p0b", 0, 3.0)]
    for rid, prio, arr in specs:
        sched.add_request(make_req(rid, 3, max_tokens=1, priority=prio, arrival=arr))
    admitted = []
    run_to_end(sched, check=lambda s, out: admitted.extend(n.req_id for n in out.scheduled_new_reqs))
    assert admitted == ["p0a", "p0b", "p1", "p2"]


def _victim_already_scheduled(step_budget):
    """running == [b, a, c] with a full pool; b (priority 1) is the victim,
    a needs a new block next step, b and c do not. The next step runs with a
    budget of ``step_budget`` tokens; d waits and would fit after b is freed."""
    sched = make_sched(num_blocks=5, policy="priority")
    b = make_req("b", 4, max_tokens=8, priority=1, arrival=0.0)
    a = make_req("a", 8, max_tokens=8, priority=0, arrival=1.0)
    c = make_req("c", 3, max_tokens=8, priority=0, arrival=2.0)
    d = make_req("d", 3, max_tokens=8, priority=0, arrival=3.0)
    sched.add_request(b)
    step(sched)
    for r in (a, c, d):
        sched.add_request(r)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"b": 1, "a": 8, "c": 3}  # d does not fit
    assert [r.request_id for r in sched.running] == ["b", "a", "c"]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    sched.config.max_num_batched_tokens = step_budget
    return sched, a, b, c, d


def test_preempting_an_already_scheduled_request_returns_its_budget():
    sched, a, b, c, d = _victim_already_scheduled(step_budget=2)
    out, _ = step(sched)
    # b got 1 token, then was preempted for a: its token goes back to the
    # budget, so c still gets one.
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1, "c": 1}
    assert out.total_num_scheduled_tokens == 2
    assert {x.req_id for x in out.scheduled_cached_reqs} == {"a", "c"}
    assert b.num_computed_tokens == 0
    assert b.status == RequestStatus.PREEMPTED
    assert "b" not in sched.kv_cache_manager.req_to_blocks
    sched.config.max_num_batched_tokens = 2048
    finished = run_to_end(sched)
    assert set(finished) == {"a", "b", "c", "d"}
    assert b.num_output_tokens == 8
    assert_no_leak(sched)


def test_no_admission_in_a_step_that_preempted():
    sched, a, b, c, d = _victim_already_scheduled(step_budget=64)
    out, _ = step(sched)
    assert out.preempted_req_ids == {"b"}
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() >= 1  # d would fit
    assert "d" not in out.num_scheduled_tokens
    assert d.status == RequestStatus.WAITING
    run_to_end(sched)
    assert d.num_output_tokens == 8
    assert_no_leak(sched)


def test_pending_prefill_tokens_count_what_is_left_to_prefill():
    """Three 10-token prompts under a 16-token budget: 9 each before any step (the last prompt token is
    the one each computes as it samples), then a done, 3 of b's left and c untouched, then none."""
    sched = make_sched(max_num_batched_tokens=16)
    for i, rid in enumerate("abc"):
        sched.add_request(make_req(rid, 10, max_tokens=5, arrival=float(i)))
    backlog = [sched.num_pending_prefill_tokens()]
    for _ in range(2):
        step(sched)
        backlog.append(sched.num_pending_prefill_tokens())
    assert backlog == [27, 3 + 9, 0]
    assert set(run_to_end(sched)) == {"a", "b", "c"} and sched.num_pending_prefill_tokens() == 0
