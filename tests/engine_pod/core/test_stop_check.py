"""When the scheduler ends a request (core/stop_check.py): max_tokens,
EOS, stop token ids, min_tokens, ignore_eos, max_model_len."""

from __future__ import annotations

from engine_pod.request import RequestStatus
from tests.engine_pod.core.scheduler_helpers import (
    EOS,
    SAMPLED,
    assert_no_leak,
    make_req,
    make_sched,
    run_to_end,
)


# -- stop conditions --------------------------------------------------------------


def _finish_one(req, token=SAMPLED, **cfg):
    sched = make_sched(**cfg)
    sched.add_request(req)
    finished = run_to_end(sched, token=token)
    assert_no_leak(sched)
    return finished[req.request_id]


def test_max_tokens_finishes_with_length():
    req = make_req("r", 5, max_tokens=3)
    out = _finish_one(req)
    assert out.finish_reason == "length" and out.stop_reason is None
    assert req.output_token_ids == [SAMPLED] * 3
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_eos_finishes_with_stop_and_no_stop_reason():
    req = make_req("r", 5, max_tokens=10)
    out = _finish_one(req, token=lambda r: EOS if r.num_output_tokens == 1 else SAMPLED)
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert req.output_token_ids == [SAMPLED, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_id_finishes_with_its_id_as_stop_reason():
    req = make_req("r", 5, max_tokens=10, stop_token_ids=[42])
    out = _finish_one(req, token=lambda r: 42 if r.num_output_tokens == 2 else SAMPLED)
    assert out.finish_reason == "stop" and out.stop_reason == 42
    assert req.stop_reason == 42
    assert req.output_token_ids == [SAMPLED, SAMPLED, 42]


def test_min_tokens_suppresses_stop():
    req = make_req("r", 5, max_tokens=10, min_tokens=3)
    out = _finish_one(req, token=EOS)
    assert out.finish_reason == "stop"
    assert req.output_token_ids == [EOS, EOS, EOS]


def test_ignore_eos_ignores_eos():
    req = make_req("r", 5, max_tokens=4, ignore_eos=True)
    out = _finish_one(req, token=EOS)
    assert out.finish_reason == "length"
    assert req.output_token_ids == [EOS] * 4


def test_max_model_len_caps_generation():
    req = make_req("r", 8, max_tokens=100)
    out = _finish_one(req, max_model_len=12)
    assert out.finish_reason == "length"
    assert req.num_tokens == 12
    assert req.num_output_tokens == 4
