"""A pool of one-pod processes whose size changes during a run, with each
pod's lifecycle as Kubernetes would give it (the autoscale scenario):

    starting     the process runs, not listed: it loads its model
    ready        listed in the pods file: it serves AND `startup_delay_s`
                 have passed since it started (the delay stands in for
                 model loading; a simulated pod is up in about a second)
    terminating  unlisted first, then SIGTERM `removal_grace_s` later (the
                 gateways poll the file, so they stop routing to it before
                 it refuses new requests); in-flight requests finish
    exited       the process has ended

`scale_to(n)` keeps n pods starting or ready, as a Deployment keeps its
replicas: surplus pods go starting ones first, then the most recently
ready (a ReplicaSet's order). Every pod counts from its process start to
its exit (pod-minutes). Nothing here reads a clock: callers pass `now`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tessera_tools.bench.fleet.pods_file import PodsFile


class PodHandle(Protocol):
    """One pod's process, as the pool drives it."""

    address: str
    metrics_url: str

    def serving(self) -> bool: ...
    def request_stop(self) -> None: ...
    def exit_code(self) -> int | None: ...
    def close(self) -> None: ...


@dataclass
class ElasticPod:
    name: str
    handle: PodHandle
    started_at: float
    ready_at: float | None = None
    """Listed in the pods file."""
    removed_at: float | None = None
    """Chosen for removal: unlisted (if it was listed)."""
    stop_sent_at: float | None = None
    """SIGTERM sent."""
    exited_at: float | None = None
    exit_code: int | None = None

    @property
    def state(self) -> str:
        if self.exited_at is not None:
            return "exited"
        if self.removed_at is not None:
            return "terminating"
        return "ready" if self.ready_at is not None else "starting"

    def seconds_within(self, start: float, end: float) -> float:
        """Seconds this pod existed within [start, end]."""
        until = end if self.exited_at is None else min(end, self.exited_at)
        return max(0.0, until - max(start, self.started_at))


@dataclass(frozen=True)
class PoolTimings:
    startup_delay_s: float
    """A pod is listed no earlier than this after its process started."""
    removal_grace_s: float
    """Seconds between unlisting a pod and its SIGTERM: a few of the gateways' file polls."""


class ElasticPool:
    def __init__(self, launch: Callable[[str], PodHandle], pods_file: PodsFile, timings: PoolTimings,
                 role: str = "mixed") -> None:
        self.launch = launch
        self.pods_file = pods_file
        self.timings = timings
        self.role = role
        """The pool's pods are listed under this role (pools of one fleet share the pods file)."""
        self.pods: list[ElasticPod] = []
        self.events: list[dict] = []
        """(t, pod, event) of every lifecycle change, in order."""

    def in_state(self, state: str) -> list[ElasticPod]:
        return [p for p in self.pods if p.state == state]

    @property
    def active(self) -> list[ElasticPod]:
        """Starting or ready: what a Deployment counts against its replicas."""
        return [p for p in self.pods if p.state in ("starting", "ready")]

    def counts(self) -> dict[str, int]:
        states = [p.state for p in self.pods]
        return {s: states.count(s) for s in ("starting", "ready", "terminating")}

    def scale_to(self, replicas: int, now: float) -> None:
        active = self.active
        for _ in range(replicas - len(active)):
            name = f"pod{len(self.pods)}"
            self.pods.append(ElasticPod(name, self.launch(name), now))
            self._event(now, self.pods[-1], "started")
        surplus = len(active) - replicas
        if surplus > 0:
            starting = [p for p in active if p.ready_at is None][::-1]
            order = {id(p): i for i, p in enumerate(self.pods)}
            ready = sorted((p for p in active if p.ready_at is not None), key=lambda p: (p.ready_at, order[id(p)]),
                           reverse=True)
            for pod in (starting + ready)[:surplus]:
                self._remove(pod, now)

    def _remove(self, pod: ElasticPod, now: float) -> None:
        pod.removed_at = now
        if pod.ready_at is not None:
            self.pods_file.remove(pod.handle.address, self.role)  # first: no gateway routes to it any more ...
            self._event(now, pod, "unlisted")
        else:
            self._stop(pod, now)  # never listed: nothing to wait for

    def _stop(self, pod: ElasticPod, now: float) -> None:
        pod.handle.request_stop()  # ... then it drains
        pod.stop_sent_at = now
        self._event(now, pod, "sigterm")

    def step(self, now: float) -> None:
        """Advance every pod's lifecycle (called often: every 0.1 s)."""
        for pod in self.pods:
            if pod.exited_at is not None:
                continue
            code = pod.handle.exit_code()
            if code is not None:
                self._exited(pod, code, now)
            elif pod.state == "starting":
                if now - pod.started_at >= self.timings.startup_delay_s and pod.handle.serving():
                    pod.ready_at = now
                    self.pods_file.add(pod.handle.address, self.role)
                    self._event(now, pod, "listed")
            elif pod.state == "terminating" and pod.stop_sent_at is None \
                    and now - pod.removed_at >= self.timings.removal_grace_s:
                self._stop(pod, now)

    def _exited(self, pod: ElasticPod, code: int, now: float) -> None:
        if pod.state == "ready":  # it died while listed (a crash, not a scale-down)
            self.pods_file.remove(pod.handle.address, self.role)
        pod.exited_at, pod.exit_code = now, code
        self._event(now, pod, "exited", exit_code=code)

    def pod_seconds(self, start: float, end: float) -> float:
        return sum(p.seconds_within(start, end) for p in self.pods)

    def close(self) -> None:
        close_pools([self])

    def _event(self, now: float, pod: ElasticPod, event: str, **extra) -> None:
        self.events.append({"t": now, "pod": pod.name, "address": pod.handle.address, "event": event, **extra})


def close_pools(pools: list[ElasticPool]) -> None:
    """Stop every process still running in the pools, all signalled first so their drains overlap."""
    live = [p for pool in pools for p in pool.pods if p.exited_at is None]
    for pod in live:
        pod.handle.request_stop()
    for pod in live:
        pod.handle.close()
