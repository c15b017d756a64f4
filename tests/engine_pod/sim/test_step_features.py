"""StepFeatures of real SchedulerOutputs from the real Scheduler (block
size 4): prefill, chunked prefill, decode and a mixed step, exactly."""

from __future__ import annotations

from engine_pod.sim.step_features import step_features
from engine_pod.sim.step_profile import StepFeatures
from tests.engine_pod.core.scheduler_helpers import make_req, make_sched, step


def test_a_prefill_step():
    sched = make_sched()
    sched.add_request(make_req("a", 10))
    sched.add_request(make_req("b", 6))
    out, _ = step(sched)
    assert step_features(out) == StepFeatures(num_prefill_tokens=16, num_decode_seqs=0, num_context_tokens=0)


def test_a_chunked_prefill_then_decode():
    sched = make_sched(max_num_batched_tokens=8)
    sched.add_request(make_req("a", 10))
    sched.add_request(make_req("b", 3))
    out, _ = step(sched)  # a's first chunk fills the budget
    assert step_features(out) == StepFeatures(8, 0, 0)
    out, _ = step(sched)  # a (cached, 8 computed) finishes its prompt; b prefills whole
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["a"]
    assert step_features(out) == StepFeatures(num_prefill_tokens=2 + 3, num_decode_seqs=0, num_context_tokens=8)
    out, _ = step(sched)  # both decode, attending to their prompts
    assert step_features(out) == StepFeatures(num_prefill_tokens=0, num_decode_seqs=2, num_context_tokens=10 + 3)
    out, _ = step(sched)  # and the token each sampled
    assert step_features(out) == StepFeatures(0, 2, 11 + 4)


def test_a_mixed_step():
    sched = make_sched()
    sched.add_request(make_req("a", 10))
    step(sched)
    sched.add_request(make_req("c", 6))
    out, _ = step(sched)  # a decodes, c prefills
    assert step_features(out) == StepFeatures(num_prefill_tokens=6, num_decode_seqs=1, num_context_tokens=10)


def test_kv_bytes_moved_count_every_block_the_connector_copies():
    from engine_pod.core.scheduler_output import KVConnectorMetadata

    sched = make_sched()
    sched.add_request(make_req("a", 10))
    out, _ = step(sched)
    assert step_features(out, kv_bytes_per_block=100).kv_bytes_moved == 0  # no KV store
    out.kv_connector = KVConnectorMetadata(offloads=[(1, b"h1")], loads=[(2, memoryview(b"")), (3, memoryview(b""))],
                                           saves=[(4, b"h4", True)])
    assert step_features(out, kv_bytes_per_block=100).kv_bytes_moved == 4 * 100
    assert step_features(out) == StepFeatures(num_prefill_tokens=10, num_decode_seqs=0, num_context_tokens=0)
