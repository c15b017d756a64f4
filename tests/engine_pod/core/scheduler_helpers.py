"""Driving the scheduler without a model (shared by the scheduler's tests).

A fake runner samples one token for every request whose scheduled tokens
reach the end of its tokens (schedule() has already advanced
num_computed_tokens, so that is num_computed_tokens == num_tokens).
"""

from __future__ import annotations

import zlib

from engine_pod.config import SchedulerConfig
from engine_pod.core.kv_cache_manager import KVCacheManager
from engine_pod.core.scheduler import Scheduler
from engine_pod.core.scheduler_output import ModelRunnerOutput
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams

BS = 4
EOS = 2
SAMPLED = 7


def make_sched(num_blocks=64, block_size=BS, caching=True, **cfg):
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size, caching))


def make_req(rid, n_prompt, max_tokens=4, priority=0, arrival=0.0, prefix=(), **params):
    sp = SamplingParams(max_tokens=max_tokens, **params)
    sp.resolve_stop_token_ids({EOS})
    # Distinct tokens per request (no accidental prefix hits), never EOS/SAMPLED.
    base = 100 * (zlib.crc32(rid.encode()) % 1_000_000 + 1)
    prompt = list(prefix) + list(range(base, base + n_prompt))
    return Request(rid, prompt, sp, priority=priority, arrival_time=arrival)


def step(sched, token=SAMPLED):
    """One engine step. ``token``: an int, or a function request -> token id."""
    out = sched.schedule()
    sampled = {}
    for rid in out.num_scheduled_tokens:
        r = sched.requests[rid]
        if r.num_computed_tokens == r.num_tokens:
            sampled[rid] = [token(r) if callable(token) else token]
    results = sched.update_from_output(out, ModelRunnerOutput(sampled))
    return out, {o.request_id: o for o in results}


def run_to_end(sched, max_steps=500, token=SAMPLED, check=None):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        out, res = step(sched, token)
        if check is not None:
            check(sched, out)
        finished.update({rid: o for rid, o in res.items() if o.finished})
    raise AssertionError("requests did not finish")


def assert_no_leak(sched):
    kv = sched.kv_cache_manager
    assert not sched.has_unfinished_requests()
    assert sched.requests == {}
    assert kv.req_to_blocks == {}
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def run_until_preemption(sched, max_steps=50):
    for _ in range(max_steps):
        out, res = step(sched)
        if out.preempted_req_ids:
            return out, res
    raise AssertionError("no preemption happened")
