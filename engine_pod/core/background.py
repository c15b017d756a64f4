"""Background requests: work (batch jobs) that runs only on the capacity
interactive requests leave idle.

A request whose priority is at least SchedulerConfig.background_priority is
background. Each step it gets nothing while another request waits or is
still prefilling (so an interactive prompt's chunks never share a step with
batch work), and otherwise at most background_max_batched_tokens for all
background requests together (so the step an interactive request arrives
behind is short). A waiting interactive request that finds no room (a
sequence slot or KV blocks) preempts background ones: they hold nothing an
interactive request needs.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_pod.config import SchedulerConfig
from engine_pod.request import Request


class BackgroundShare:
    """The background requests' share of one step, decided when it starts."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.threshold = config.background_priority
        self.max_tokens = config.background_max_batched_tokens
        self.tokens_left = 0

    def is_background(self, request: Request) -> bool:
        return self.threshold is not None and request.priority >= self.threshold

    def start_step(self, running: Iterable[Request], first_waiting: Request | None) -> None:
        """Background requests yield this step if any other request waits or prefills."""
        if self.threshold is None:
            return
        foreground_busy = (first_waiting is not None and not self.is_background(first_waiting)) or any(
            not self.is_background(r) and r.num_tokens - r.num_computed_tokens > 1 for r in running
        )
        self.tokens_left = 0 if foreground_busy else self.max_tokens

    def count(self, requests: Iterable[Request]) -> int:
        """How many of `requests` are background (none, without looking, when there is no class)."""
        return 0 if self.threshold is None else sum(map(self.is_background, requests))

    def limit(self, request: Request, budget: int) -> int:
        """Tokens `request` may take of the step's remaining `budget`."""
        return min(budget, self.tokens_left) if self.is_background(request) else budget

    def took(self, request: Request, num_tokens: int) -> None:
        """Account tokens scheduled (or, negative, handed back by a preemption)."""
        if self.is_background(request):
            self.tokens_left -= num_tokens

    def victim(self, running: list[Request], scheduled: Iterable[Request]) -> Request | None:
        """The background request a waiting interactive one may preempt: the
        lowest-priority, latest-arrived among those not scheduled this step."""
        taken = set(scheduled)
        candidates = [r for r in running if self.is_background(r) and r not in taken]
        return max(candidates, key=lambda r: (r.priority, r.arrival_time), default=None)
