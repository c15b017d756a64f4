"""The scheduler under speculative decoding, driven without a model.

A fake target model is a deterministic function of the context, so a fake
runner verifies drafts exactly as greedy verification does: accept while
the draft equals the model's next token, then emit the model's token.
"""

from __future__ import annotations

import random

from engine_pod.core.scheduler_output import ModelRunnerOutput
from tests.engine_pod.core.scheduler_helpers import BS, EOS, assert_no_leak, make_req, make_sched


def model(ctx: list[int]) -> int:
    """The next token of a context; now and then EOS."""
    if len(ctx) % 23 == 0:
        return EOS
    return 10 + (ctx[-1] * 7 + ctx[-2] * 3 + len(ctx)) % 40


def spec_step(sched, drafter=None):
    """One engine step; ``drafter(request id, verified context) -> drafts``."""
    out = sched.schedule()
    sampled, drafts = {}, {}
    for rid in out.num_scheduled_tokens:
        r = sched.requests[rid]
        scheduled = out.scheduled_spec_decode_tokens.get(rid, [])
        if r.num_computed_tokens != r.num_tokens + len(scheduled):
            continue  # a prefill chunk short of the end
        ctx, emitted = list(r.all_token_ids), []
        for t in scheduled:
            if t != model(ctx):
                break
            emitted.append(t)
            ctx.append(t)
        emitted.append(model(ctx))
        ctx.append(emitted[-1])
        sampled[rid] = emitted
        if drafter is not None:
            drafts[rid] = drafter(rid, ctx)
    results = sched.update_from_output(out, ModelRunnerOutput(sampled, draft_token_ids=drafts))
    return out, {o.request_id: o for o in results}


def run(sched, requests, drafter=None, max_steps=2000):
    for r in requests:
        sched.add_request(r)
    tokens = {r.request_id: [] for r in requests}
    finish, preempted = {}, 0
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens, finish, preempted
        out, res = spec_step(sched, drafter)
        preempted += len(out.preempted_req_ids)
        for rid, o in res.items():
            tokens[rid] += o.new_token_ids
            if o.finished:
                finish[rid] = (o.finish_reason, o.stop_reason)
        for r in sched.running:
            # Only verified tokens: a decoding request has computed all but its last.
            assert r.num_computed_tokens <= r.num_tokens - 1 or r.num_computed_tokens < r.num_prompt_tokens
            assert sched.kv_cache_manager.num_cached_blocks.get(r.request_id, 0) * BS <= r.num_tokens
    raise AssertionError("requests did not finish")


def noisy_drafter(seed: int, k: int = 4):
    """Drafts the model's true continuation, corrupted at a random position
    (or not at all), so every acceptance length occurs."""
    rng = random.Random(seed)

    def drafter(rid, ctx):
        ctx, out = list(ctx), []
        for _ in range(rng.randrange(0, k + 1)):
            out.append(model(ctx))
            ctx.append(out[-1])
        if out and rng.random() < 0.5:
            out[rng.randrange(len(out))] = 49  # never the model's choice here
        return out

    return drafter


def workload(n=12):
    rng = random.Random(7)
    reqs = []
    for i in range(n):
        kw = {}
        if i % 4 == 1:
            kw["stop_token_ids"] = [10 + i]
        if i % 4 == 2:
            kw["ignore_eos"] = True
        reqs.append(make_req(f"r{i}", rng.randrange(1, 30), max_tokens=rng.randrange(1, 40), **kw))
    return reqs


def test_outputs_equal_non_speculative_decoding_under_preemption_and_small_budget():
    cfg = dict(num_blocks=20, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=48)
    want, want_finish, _ = run(make_sched(**cfg), workload())
    sched = make_sched(**cfg)
    got, got_finish, preempted = run(sched, workload(), noisy_drafter(0))
    assert got == want and got_finish == want_finish
    assert preempted > 0
    drafted = sched.spec_decode_stats
    assert 0 < drafted.num_accepted_tokens < drafted.num_draft_tokens
    assert_no_leak(sched)


def test_stats_count_drafts_and_accepted_tokens():
    sched = make_sched(num_blocks=64)
    sched.add_request(make_req("a", 6, max_tokens=30, ignore_eos=True))
    totals = [0, 0, 0]
    drafter = noisy_drafter(1)
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        out, _ = spec_step(sched, drafter)
        s = sched.make_stats().spec_decode
        assert s.num_drafts == len(out.scheduled_spec_decode_tokens)
        assert s.num_draft_tokens == sum(map(len, out.scheduled_spec_decode_tokens.values()))
        totals = [totals[0] + s.num_drafts, totals[1] + s.num_draft_tokens, totals[2] + s.num_accepted_tokens]
    assert totals[0] > 0 and 0 < totals[2] < totals[1]


def decoding_request(sched, n_prompt=5, **params):
    """A request that has prefilled (in chunks if the budget says so) and
    sampled one token."""
    r = make_req("a", n_prompt, **params)
    sched.add_request(r)
    while not r.output_token_ids:
        spec_step(sched)
    return r


def test_drafts_follow_the_last_token_and_count_in_the_budget():
    sched = make_sched(max_num_batched_tokens=3)
    r = decoding_request(sched, max_tokens=20)
    r.spec_token_ids = [11, 12, 13, 14]
    start = r.num_computed_tokens
    out = sched.schedule()
    # Budget 3: the last verified token and two drafts.
    assert out.num_scheduled_tokens == {"a": 3}
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12]}
    assert r.num_computed_tokens == start + 3
    assert sched.kv_cache_manager.num_allocated_slots("a") >= start + 3


def test_drafts_beyond_max_tokens_or_max_model_len_are_not_scheduled():
    sched = make_sched()
    r = decoding_request(sched, max_tokens=3)  # one token out, two to go
    r.spec_token_ids = [11, 12, 13]
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [11]}

    sched = make_sched(max_model_len=8)
    r = decoding_request(sched, n_prompt=5, max_tokens=20)  # 6 tokens, 2 to the cap
    r.spec_token_ids = [11, 12, 13]
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [11]}


def test_rejected_drafts_roll_back_num_computed_tokens():
    sched = make_sched()
    r = decoding_request(sched, max_tokens=20, ignore_eos=True)
    n = r.num_tokens
    truth = model(list(r.all_token_ids))
    r.spec_token_ids = [truth, 49, 49]  # the first is accepted, the second rejected
    out, res = spec_step(sched)
    assert out.num_scheduled_tokens == {"a": 4}
    assert len(res["a"].new_token_ids) == 2
    assert r.num_tokens == n + 2 and r.num_computed_tokens == r.num_tokens - 1


def test_blocks_holding_unverified_drafts_are_never_hashed():
    sched = make_sched(block_size=BS)
    r = decoding_request(sched, n_prompt=5, max_tokens=20, ignore_eos=True)  # 6 tokens
    kv = sched.kv_cache_manager
    r.spec_token_ids = [49, 49]  # positions 6 and 7 would complete block 1; both wrong
    spec_step(sched)
    block1 = kv.req_to_blocks["a"][1]
    assert kv.num_cached_blocks["a"] == 1 and block1.block_hash is None
    spec_step(sched)  # computes position 6 (verified): 8 tokens now, block 1 full
    spec_step(sched)  # computes position 7: block 1 is cached, from the verified tokens
    assert kv.num_cached_blocks["a"] == 2
    assert block1.block_hash == r.block_hashes[1]
    assert 49 not in r.all_token_ids[4:8]


def test_a_stop_among_accepted_tokens_truncates_the_rest():
    sched = make_sched()
    r = decoding_request(sched, max_tokens=30, stop_token_ids=[])
    ctx = list(r.all_token_ids)
    drafts = []
    while len(drafts) < 3:
        drafts.append(model(ctx))
        ctx.append(drafts[-1])
    r.sampling_params.all_stop_token_ids.add(drafts[1])
    r.spec_token_ids = drafts
    _, res = spec_step(sched)
    assert res["a"].new_token_ids == drafts[:2]
    assert res["a"].finish_reason == "stop"
    assert r.output_token_ids[-1] == drafts[1]
    assert_no_leak(sched)


def test_drafts_are_dropped_before_preempting_another_request():
    sched = make_sched(num_blocks=3, block_size=BS)
    a = make_req("a", 3, max_tokens=20, ignore_eos=True, arrival=0.0)
    b = make_req("b", 3, max_tokens=20, ignore_eos=True, arrival=1.0)
    for r in (a, b):
        sched.add_request(r)
    spec_step(sched)  # both prefill (a block each) and sample: 4 tokens each
    a.spec_token_ids = [11, 12, 13, 14, 15]  # positions 4-8 need 2 more blocks; 1 is free
    out = sched.schedule()
    assert out.preempted_req_ids == set()
    assert out.scheduled_spec_decode_tokens == {}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_preemption_drops_a_requests_drafts():
    sched = make_sched(num_blocks=2, block_size=BS)
    a = make_req("a", 4, max_tokens=20, ignore_eos=True, arrival=0.0)
    b = make_req("b", 4, max_tokens=20, ignore_eos=True, arrival=1.0)
    for r in (a, b):
        sched.add_request(r)
    spec_step(sched)  # each fills its block and samples a 5th token
    b.spec_token_ids = [11]
    out = sched.schedule()  # a's 5th token needs a new block: b (latest) is preempted
    assert out.preempted_req_ids == {"b"}
    assert b.spec_token_ids == []
