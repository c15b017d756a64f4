"""A node failure at a set time of the trace: SIGKILL some pod processes at
once, then watch each gateway until it stops routing to their pods.

From the kill on, every FAST_POLL_S each gateway's /metrics gives
- `tessera_gateway_pods_routable{role="mixed"}`: the gateway has stopped
  routing to the killed pods once it has dropped by their number (from the
  value read just before the kill);
- `tessera_gateway_routing_decisions_total` of the killed pods (every
  kind: route, retry): the last poll at which it grew is the last time a
  killed pod got a routing decision (to within a poll).
Once every gateway has dropped, polls slow to SLOW_POLL_S until stop().
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_pod.server.process import SimulatedPodsProcess
from tessera_tools.bench.fleet.elastic_fleet import fetch_text

ROUTABLE = "tessera_gateway_pods_routable"
ROUTED = "tessera_gateway_routing_decisions_total"
FAST_POLL_S = 0.05
SLOW_POLL_S = 0.25
_POD_LABEL = re.compile(r'pod="([^"]*)"')


def routable_and_routed(text: str, killed: set[str]) -> tuple[float, float]:
    """(mixed pods routable, routing decisions to the killed pods) from a gateway's metrics text.
    A plain scan for the two names: polled 20 times a second, the full parser would cost the client CPU."""
    routable = routed = 0.0
    for line in text.splitlines():
        if line.startswith(ROUTABLE + "{") and 'role="mixed"' in line:
            routable += float(line.rsplit(" ", 1)[1])
        elif line.startswith(ROUTED + "{"):
            pod = _POD_LABEL.search(line)
            if pod and pod.group(1) in killed:
                routed += float(line.rsplit(" ", 1)[1])
    return routable, routed


@dataclass
class GatewayWatch:
    """One gateway seen around the kill (times: time.monotonic())."""

    routable_before: float
    routed_before: float
    routable_now: float
    routed_now: float
    dropped_at: float | None = None
    """First poll at which routable had dropped by the number of killed pods."""
    last_routed_at: float | None = None
    """Last poll at which the killed pods' routing decisions had grown."""


class NodeFailure(threading.Thread):
    """arm(t0) from the replay's start; the kill comes `offset_s` later."""

    def __init__(self, victims: list[SimulatedPodsProcess], gateway_metrics_urls: list[str], offset_s: float,
                 fetch: Callable[[str], str] = fetch_text) -> None:
        super().__init__(name="fleet-node-failure", daemon=True)
        self.victims, self.urls, self.offset_s, self.fetch = victims, gateway_metrics_urls, offset_s, fetch
        self.killed = {a for v in victims for a in v.addresses}
        self.t0: float | None = None
        self.killed_at: float | None = None
        self.watches: list[GatewayWatch | None] = []
        self.polls = 0
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def arm(self, t0: float) -> None:
        self.t0 = t0
        self.start()

    def _read(self, url: str) -> tuple[float, float] | None:
        try:
            return routable_and_routed(self.fetch(url), self.killed)
        except OSError:  # a gateway slow to answer: the next poll will tell
            return None

    def run(self) -> None:
        try:
            if self._stop_event.wait(max(0.0, self.t0 + self.offset_s - time.monotonic())):
                return
            before = [self._read(url) for url in self.urls]
            self.watches = [GatewayWatch(b[0], b[1], b[0], b[1]) if b else None for b in before]
            self.killed_at = time.monotonic()
            for victim in self.victims:
                victim.proc.kill()
            while not self._stop_event.wait(self._poll_interval()):
                self._poll(time.monotonic())
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by stop()
            self.error = e

    def _poll_interval(self) -> float:
        watching = any(w is None or w.dropped_at is None for w in self.watches)
        return FAST_POLL_S if watching else SLOW_POLL_S

    def _poll(self, now: float) -> None:
        self.polls += 1
        for i, url in enumerate(self.urls):
            seen = self._read(url)
            if seen is None:
                continue
            watch = self.watches[i]
            if watch is None:  # no reading before the kill: this first one stands in
                watch = self.watches[i] = GatewayWatch(seen[0] + len(self.killed), seen[1], *seen)
            routable, routed = seen
            if watch.dropped_at is None and routable <= watch.routable_before - len(self.killed):
                watch.dropped_at = now
            if routed > watch.routed_now:
                watch.last_routed_at = now
            watch.routable_now, watch.routed_now = routable, routed

    def stop(self) -> None:
        self._stop_event.set()
        if self.ident is not None:
            self.join()
        if self.error is not None:
            raise RuntimeError(f"the node failure thread failed: {self.error!r}") from self.error

    def record(self) -> dict:
        """The kill and each gateway's view of it (seconds from the kill)."""
        def after(t: float | None) -> float | None:
            return None if t is None or self.killed_at is None else t - self.killed_at

        gateways = [None if w is None else {
            "routable_before": w.routable_before, "routable_after": w.routable_now,
            "stopped_routing_after_s": after(w.dropped_at),
            "last_routing_decision_after_s": after(w.last_routed_at),
            "routing_decisions_after_kill": w.routed_now - w.routed_before,
        } for w in self.watches]
        seen = [g for g in gateways if g is not None]
        stopped = [g["stopped_routing_after_s"] for g in seen]
        last = [g["last_routing_decision_after_s"] for g in seen if g["last_routing_decision_after_s"] is not None]
        return {
            "kill_at_s": None if self.killed_at is None else self.killed_at - self.t0,
            "killed_pods": sorted(self.killed), "gateways": gateways,
            "routing_stopped_after_s": max(stopped) if stopped and None not in stopped else None,
            "every_gateway_stopped": bool(seen) and len(seen) == len(gateways) and None not in stopped,
            "last_routing_decision_after_s": max(last) if last else None,
            "poll_interval_ms": FAST_POLL_S * 1e3, "polls": self.polls,
        }
