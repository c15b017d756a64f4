"""The gateway's wait queue: weighted fair across priority classes,
round-robin across tenants within a class, FIFO within a tenant.

Across classes this is stride scheduling on virtual time: each class has a
`pass` that advances by 1/weight per dispatch, and the waiting class with the
lowest pass goes next, so while classes wait together their dispatch counts
follow their weights. A class that becomes non-empty starts at the current
virtual time, never behind it: idle time banks no credit.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _ClassQueue(Generic[T]):
    weight: float
    rank: int  # engine priority: breaks ties in `pass`, lower first
    pass_: float = 0.0
    size: int = 0
    # tenant -> its FIFO; dict order is the round-robin order.
    tenants: OrderedDict[str, deque[T]] = field(default_factory=OrderedDict)


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._classes: dict[str, _ClassQueue[T]] = {}
        self._virtual_time = 0.0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def len_by_class(self) -> dict[str, int]:
        return {name: q.size for name, q in self._classes.items() if q.size}

    def push(self, item: T, *, class_name: str, weight: float, rank: int, tenant: str) -> None:
        queue = self._classes.get(class_name)
        if queue is None:
            queue = self._classes[class_name] = _ClassQueue(weight, rank, pass_=self._virtual_time)
        queue.weight, queue.rank = weight, rank
        if queue.size == 0:
            queue.pass_ = max(queue.pass_, self._virtual_time)
        queue.tenants.setdefault(tenant, deque()).append(item)
        queue.size += 1
        self._len += 1

    def pop(self) -> T:
        """The next item to dispatch; IndexError when empty."""
        waiting = [(q.pass_, q.rank, name) for name, q in self._classes.items() if q.size]
        if not waiting:
            raise IndexError("pop from an empty FairQueue")
        _, _, name = min(waiting)
        queue = self._classes[name]
        self._virtual_time = queue.pass_
        queue.pass_ += 1.0 / queue.weight
        tenant, items = next(iter(queue.tenants.items()))
        item = items.popleft()
        if items:
            queue.tenants.move_to_end(tenant)  # this tenant goes to the back of the round
        else:
            del queue.tenants[tenant]
        queue.size -= 1
        self._len -= 1
        return item

    def remove(self, item: T, *, class_name: str, tenant: str) -> bool:
        """Take out a waiting item (timeout, cancellation); False if not queued."""
        queue = self._classes.get(class_name)
        items = queue.tenants.get(tenant) if queue is not None else None
        if items is None or item not in items:
            return False
        items.remove(item)
        if not items:
            del queue.tenants[tenant]
        queue.size -= 1
        self._len -= 1
        return True
