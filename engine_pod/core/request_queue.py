"""Waiting queues for the FCFS and priority scheduling policies."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine_pod.config import SchedulingPolicy
from engine_pod.request import Request


class FCFSRequestQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lower priority value first, then earlier arrival.

    A heap; removal (aborts) marks entries dead and skips them lazily, so
    every operation stays O(log n).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        # request -> sequence number of its one live heap entry
        self._live: dict[Request, int] = {}

    def add(self, request: Request) -> None:
        seq = next(self._counter)
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))
        self._live[request] = seq

    def _is_live(self, entry: tuple[int, float, int, Request]) -> bool:
        return self._live.get(entry[3]) == entry[2]

    # A preempted request keeps its priority and arrival time, so its place
    # in the heap is the right one.
    prepend = add

    def _drop_dead(self) -> None:
        while self._heap and not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)

    def peek(self) -> Request:
        self._drop_dead()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_dead()
        request = heapq.heappop(self._heap)[3]
        del self._live[request]
        return request

    def remove(self, request: Request) -> None:
        del self._live[request]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap) if self._is_live(entry))


def create_request_queue(policy: SchedulingPolicy) -> FCFSRequestQueue | PriorityRequestQueue:
    return PriorityRequestQueue() if policy == SchedulingPolicy.PRIORITY else FCFSRequestQueue()
