"""The operator's autoscaler in the loop: every interval, what the operator
would observe of the pool (operator/tessera_operator/observe.py, with the
pods file standing in for the cluster), the operator's own `decide()`, and
the pool scaled to its answer.

The observation is built as observe_pool builds it: the ready pods'
/metrics through `parse_pod_metrics`, the signal from `pool_signals` with
the previous tick's samples (latency signals are interval means), ready and
pending (starting) counts, `busy`, and the requests the gateways hold in
their admission queues (`parse_gateway_queued`, summed over replicas: the
only signal at zero pods, and passed to `pool_signals` as part of the
`concurrency` signal). A pod or gateway that does not answer a scrape is
left out, as the operator leaves it out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tessera_operator.autoscale import Decision, PoolObservation, ScalerState, ScalingPolicy, decide
from tessera_operator.signals import PodSample, parse_gateway_queued, parse_pod_metrics, pool_signals
from tessera_tools.bench.fleet.elastic_pool import ElasticPool

SCRAPE_THREADS = 16


def _scrape_all(fetch: Callable[[str], str], urls: dict[str, str],
                clock: Callable[[], float]) -> dict[str, tuple[str, float]]:
    """{name: (text, when it was read)} of the urls that answered."""
    def one(item):
        try:
            return item[0], (fetch(item[1]), clock())
        except Exception:  # noqa: BLE001 - a silent pod must not stop scaling the rest (observe.py does the same)
            return item[0], None

    with ThreadPoolExecutor(SCRAPE_THREADS) as pool:
        return {name: got for name, got in pool.map(one, urls.items()) if got is not None}


class Autoscaler:
    def __init__(self, policy: ScalingPolicy, pool: ElasticPool, fetch: Callable[[str], str],
                 gateway_metrics_urls: list[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        """Stamps each scrape (the concurrency signal is a counter's rate between two)."""
        self.pool = pool
        self.fetch = fetch
        self.gateway_metrics_urls = gateway_metrics_urls
        self.replicas = len(pool.active)
        """What the Deployment asks for (PoolObservation.replicas)."""
        self.state = ScalerState()
        self.memory: dict[str, PodSample] = {}
        self.ticks: list[dict] = []
        """Per tick: the observation, the decision, the pool's counts."""

    def observe(self) -> PoolObservation:
        # The gateways first, as the operator's tick scrapes them before the pools.
        gateways = _scrape_all(self.fetch, dict(enumerate(self.gateway_metrics_urls)), self.clock)
        queued = sum(parse_gateway_queued(text) for text, _ in gateways.values())
        ready = self.pool.in_state("ready")
        texts = _scrape_all(self.fetch, {p.handle.address: p.handle.metrics_url for p in ready}, self.clock)
        samples = {name: parse_pod_metrics(text, scraped_at=at) for name, (text, at) in texts.items()}
        signals = pool_signals(samples, self.memory, gateway_queued=queued)
        self.memory = samples
        return PoolObservation(replicas=self.replicas, ready=len(ready), pending=len(self.pool.in_state("starting")),
                               signal=signals.value(self.policy.signal), busy=signals.busy, gateway_queued=queued)

    def tick(self, now: float) -> Decision:
        obs = self.observe()
        decision = decide(self.policy, obs, self.state, now)
        self.replicas = decision.replicas
        self.pool.scale_to(decision.replicas, now)
        self.ticks.append({"t": now, "asked": decision.replicas, "previous": decision.previous,
                           "reason": decision.reason, "message": decision.message, "signal": obs.signal,
                           "busy": obs.busy, "gateway_queued": obs.gateway_queued, **self.pool.counts()})
        return decision


class ControlLoop(threading.Thread):
    """The pool's lifecycle every `step_s`, and (with an autoscaler) a tick
    every `interval_s` from the start; runs until `stop()`. An exception
    ends the loop and is raised again by `stop()`."""

    def __init__(self, pool: ElasticPool, autoscaler: Autoscaler | None, interval_s: float, step_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name="fleet-autoscaler", daemon=True)
        self.pool, self.autoscaler = pool, autoscaler
        self.interval_s, self.step_s, self.clock = interval_s, step_s, clock
        self._stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        next_tick = self.clock()
        try:
            while not self._stop_event.is_set():
                now = self.clock()
                self.pool.step(now)
                if self.autoscaler is not None and now >= next_tick:
                    self.autoscaler.tick(now)
                    next_tick += self.interval_s
                    if next_tick < now:  # a tick took longer than the interval: keep the period, skip the lost ones
                        next_tick = now + self.interval_s
                self._stop_event.wait(self.step_s)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by stop()
            self.error = e

    def stop(self) -> None:
        """Also safe on a loop never started (its run failed before the trace)."""
        self._stop_event.set()
        if self.ident is not None:
            self.join()
        if self.error is not None:
            raise RuntimeError(f"the autoscaler loop failed: {self.error!r}") from self.error
