"""Waiting queues: FCFS and priority."""

from __future__ import annotations

import pytest

from engine_pod.config import SchedulingPolicy
from engine_pod.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams


def req(rid, priority=0, arrival=0.0):
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=1), priority=priority, arrival_time=arrival)


def rids(requests):
    return [r.request_id for r in requests]


def drain(q):
    out = []
    while len(q):
        out.append(q.pop())
    return rids(out)


def test_factory_picks_the_queue_for_the_policy():
    assert isinstance(create_request_queue(SchedulingPolicy.FCFS), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)


def test_fcfs_order_and_prepend():
    q = FCFSRequestQueue()
    a, b, c, d = req("a", arrival=3.0), req("b", arrival=1.0), req("c", arrival=2.0), req("d")
    for r in (a, b, c):
        q.add(r)
    assert len(q) == 3
    assert rids(q) == ["a", "b", "c"]  # insertion order, not arrival_time
    assert q.peek() is a
    assert q.pop() is a
    q.prepend(d)
    assert q.peek() is d
    assert rids(q) == ["d", "b", "c"]
    assert drain(q) == ["d", "b", "c"]
    assert len(q) == 0


def test_priority_order_lower_value_then_earlier_arrival():
    q = PriorityRequestQueue()
    entries = [("a", 1, 0.0), ("b", 0, 2.0), ("c", 0, 1.0), ("d", 2, -1.0), ("e", 1, 0.5)]
    for rid, prio, arr in entries:
        q.add(req(rid, prio, arr))
    assert len(q) == 5
    assert rids(q) == ["c", "b", "a", "e", "d"]
    assert q.peek().request_id == "c"
    assert drain(q) == ["c", "b", "a", "e", "d"]


def test_priority_ties_keep_insertion_order():
    q = PriorityRequestQueue()
    for rid in "xyz":
        q.add(req(rid, 1, 5.0))
    assert drain(q) == ["x", "y", "z"]


def test_priority_prepend_keeps_priority_place():
    q = PriorityRequestQueue()
    q.add(req("hi", 0, 1.0))
    q.prepend(req("lo", 5, 0.0))  # a preempted low-priority request
    assert rids(q) == ["hi", "lo"]
    assert drain(q) == ["hi", "lo"]


@pytest.mark.parametrize("queue_cls", [FCFSRequestQueue, PriorityRequestQueue])
def test_remove_arbitrary_entry(queue_cls):
    q = queue_cls()
    reqs = [req(rid, 0, float(i)) for i, rid in enumerate("abcd")]
    for r in reqs:
        q.add(r)
    q.remove(reqs[2])
    assert len(q) == 3
    assert rids(q) == ["a", "b", "d"]
    q.remove(reqs[0])  # the head
    assert q.peek() is reqs[1]
    assert drain(q) == ["b", "d"]


@pytest.mark.parametrize("queue_cls", [FCFSRequestQueue, PriorityRequestQueue])
def test_remove_then_readd_does_not_duplicate(queue_cls):
    q = queue_cls()
    a, b, c = req("a", 0, 0.0), req("b", 0, 1.0), req("c", 0, 2.0)
    for r in (a, b, c):
        q.add(r)
    q.remove(b)
    q.add(b)
    assert len(q) == 3
    assert sorted(rids(q)) == ["a", "b", "c"]
    assert len(list(q)) == 3
    popped = drain(q)
    assert sorted(popped) == ["a", "b", "c"]
    assert len(q) == 0


def test_priority_remove_readd_with_new_priority_uses_new_place():
    q = PriorityRequestQueue()
    a, b = req("a", 1, 0.0), req("b", 2, 1.0)
    q.add(a)
    q.add(b)
    q.remove(b)
    b.priority = 0
    q.add(b)
    assert rids(q) == ["b", "a"]
    assert drain(q) == ["b", "a"]


def test_priority_remove_everything_then_len_is_zero():
    q = PriorityRequestQueue()
    reqs = [req(str(i), i % 3, float(i)) for i in range(6)]
    for r in reqs:
        q.add(r)
    for r in reqs[::2]:
        q.remove(r)
    assert len(q) == 3
    assert sorted(rids(q)) == ["1", "3", "5"]
    for r in reqs[1::2]:
        q.remove(r)
    assert len(q) == 0
    assert list(q) == []
