"""The scheduler with steps in flight (pipeline parallelism: the engine
schedules the next step before the last one's tokens are back).

Driven without a model, in the order the pipelined engine core uses: several
schedule() calls, then update_from_output() of the oldest. A follower's
request states (a rank that does not sample) are kept from the
SchedulerOutputs alone, as the model runner keeps them, and must hold every
token of each step it is given.
"""

from __future__ import annotations

import torch

from engine_pod.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine_pod.request import RequestStatus
from engine_pod.worker.request_state import CachedRequestState, update_request_states
from tests.engine_pod.core.scheduler_helpers import assert_no_leak, make_req, make_sched, run_to_end

CPU = torch.device("cpu")


class Follower:
    """A non-sampling rank's request states, fed the SchedulerOutputs in order."""

    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}

    def take(self, sched, out: SchedulerOutput) -> None:
        update_request_states(self.requests, out, CPU)
        for req_id, n in out.num_scheduled_tokens.items():
            state, request = self.requests[req_id], sched.requests[req_id]
            end = state.num_computed_tokens + n
            assert state.num_tokens >= end, f"{req_id}: the follower lacks the step's input tokens"
            assert state.token_ids == request.all_token_ids[: state.num_tokens]


def schedule(sched, follower: Follower | None = None) -> tuple[SchedulerOutput, set[str]]:
    """One schedule() (passed to ``follower``), and the requests whose step
    reaches their end, so the sampling rank samples them (schedule() has
    advanced num_computed_tokens)."""
    out = sched.schedule()
    if follower is not None:
        follower.take(sched, out)
    requests = sched.requests
    ends = {r for r in out.num_scheduled_tokens if requests[r].num_computed_tokens == requests[r].num_tokens}
    return out, ends


def sampled(ends: set[str], token: int) -> ModelRunnerOutput:
    return ModelRunnerOutput({req_id: [token] for req_id in ends})


def prompt_and_decoder(num_blocks: int, b_first: bool, b_max_tokens: int = 6):
    """A scheduler of ``num_blocks`` blocks of 4 with two requests: c, a 40-token
    prompt in 8-token chunks, and b, a 4-token prompt that soon decodes."""
    sched = make_sched(num_blocks=num_blocks, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    b = make_req("b", 4, max_tokens=b_max_tokens, arrival=0.0 if b_first else 1.0)
    c = make_req("c", 40, max_tokens=2, arrival=1.0 if b_first else 0.0)
    for request in (b, c) if b_first else (c, b):
        sched.add_request(request)
    return sched, b, c


def test_a_request_with_a_step_in_flight_waits_while_a_prompt_goes_on_chunk_by_chunk():
    sched, b, c = prompt_and_decoder(64, b_first=True)
    follower = Follower()
    first, first_ends = schedule(sched, follower)
    second, second_ends = schedule(sched, follower)  # the first is still in flight
    # b sampled in the first step: its next token is not known yet, so it sits this one out;
    # c's next chunk is known and goes on.
    assert first.num_scheduled_tokens == {"b": 4, "c": 8}
    assert second.num_scheduled_tokens == {"c": 8}
    assert b.num_steps_in_flight == 1 and c.num_steps_in_flight == 2
    sched.update_from_output(first, sampled(first_ends, 11))
    sched.update_from_output(second, sampled(second_ends, 12))
    assert b.output_token_ids == [11] and c.output_token_ids == []
    third, _ = schedule(sched, follower)  # b's input is the token the follower never sampled
    assert third.num_scheduled_tokens["b"] == 1
    assert follower.requests["b"].token_ids[-1] == 11


def test_a_request_preempted_while_its_step_is_in_flight_keeps_that_token_and_resumes_after_it():
    # 6 blocks: c needs its 3rd chunk's blocks while b's decode step is in flight: b, the
    # latest arrival, is preempted in flight.
    sched, b, c = prompt_and_decoder(6, b_first=False)
    follower = Follower()
    first, ends = schedule(sched, follower)
    sched.update_from_output(first, sampled(ends, 11))  # b decodes from here
    in_flight, in_flight_ends = schedule(sched, follower)
    assert in_flight.num_scheduled_tokens == {"c": 8, "b": 1}
    preempting, _ = schedule(sched, follower)
    assert preempting.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_steps_in_flight == 1
    # Room frees up (c is aborted), but b must not resume before its step's token is in.
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    waiting, _ = schedule(sched, follower)
    assert "b" not in waiting.num_scheduled_tokens
    # The in-flight step's token was sampled from b's whole context: it stands.
    sched.update_from_output(in_flight, sampled(in_flight_ends, 12))
    assert b.output_token_ids == [11, 12] and b.status == RequestStatus.PREEMPTED
    sched.update_from_output(preempting, ModelRunnerOutput({}))
    sched.update_from_output(waiting, ModelRunnerOutput({}))
    resumed, resumed_ends = schedule(sched, follower)
    (data,) = resumed.scheduled_cached_reqs
    assert data.req_id == "b" and data.resumed_from_preemption
    assert resumed.num_scheduled_tokens["b"] == b.num_tokens  # recomputes all 6, the two outputs included
    sched.update_from_output(resumed, sampled(resumed_ends, 13))
    finished = run_to_end(sched, token=14)
    assert finished["b"].finish_reason == "length"
    assert b.output_token_ids == [11, 12, 13, 14, 14, 14]
    assert_no_leak(sched)


def test_a_request_preempted_in_flight_that_its_token_stops_ends_from_the_waiting_queue():
    sched, b, c = prompt_and_decoder(6, b_first=False, b_max_tokens=2)  # b's second token is its last
    first, ends = schedule(sched)
    sched.update_from_output(first, sampled(ends, 11))
    in_flight, in_flight_ends = schedule(sched)
    preempting, _ = schedule(sched)
    assert preempting.preempted_req_ids == {"b"}
    results = sched.update_from_output(in_flight, sampled(in_flight_ends, 12))
    assert [(o.request_id, o.finish_reason) for o in results] == [("b", "length")]
    assert "b" not in sched.requests and b not in list(sched.waiting)
    sched.update_from_output(preempting, ModelRunnerOutput({}))
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)  # 6 blocks never hold its 42 tokens
    assert_no_leak(sched)


def test_a_steps_share_of_requests_leaves_the_rest_to_the_next_step_in_flight():
    sched = make_sched(num_blocks=64, max_num_batched_tokens=256)
    requests = [make_req(f"r{i}", 8, max_tokens=4, arrival=float(i)) for i in range(5)]
    for r in requests:
        sched.add_request(r)
    first = sched.schedule(max_seqs=3)
    second = sched.schedule(max_seqs=3)
    assert list(first.num_scheduled_tokens) == ["r0", "r1", "r2"]  # admission order, up to the share
    assert list(second.num_scheduled_tokens) == ["r3", "r4"]
    assert sched.schedule(max_seqs=3).is_empty  # everyone is in flight
