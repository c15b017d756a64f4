"""The operator's autoscaler in the loop: every interval, what the operator
would observe of the pool (operator/tessera_operator/observe.py, with the
pods file standing in for the cluster), the operator's own `decide()`, and
the pool scaled to its answer.

The observation is built as observe_pool builds it: the ready pods'
/metrics through `parse_pod_metrics`, the signal from `pool_signals` with
the previous tick's samples (latency signals are interval means), ready and
pending (starting) counts, `busy`, and the requests the gateways hold in
their admission queues (summed over replicas: the only signal at zero pods,
and passed to `pool_signals` as part of the `concurrency` signal), and, for a
prefill pool, the prompts they had decode pods prefill since the last tick
for want of a prefill pod (`gateway_demand`). A pod or gateway that does not answer a scrape is
left out, as the operator leaves it out.

A fleet of several pools (prefill and decode) has an Autoscaler per pool,
each with its own policy and signal; the ControlLoop scrapes the gateways
once per tick and hands the demand to each, as the operator's tick does
(handlers._autoscale: gateway_demand once, then observe_pool per pool).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tessera_operator.autoscale import Decision, PoolObservation, ScalerState, ScalingPolicy, decide
from tessera_operator.signals import GatewayDemand, PodSample, gateway_demand, parse_pod_metrics, pool_signals
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


def scrape_gateway_demand(fetch: Callable[[str], str], urls: list[str], clock: Callable[[], float],
                          previous: dict[str, float]) -> tuple[GatewayDemand, dict[str, float]]:
    """The demand of the gateways that answered (signals.gateway_demand), and their counters now."""
    gateways = _scrape_all(fetch, {url: url for url in urls}, clock)
    return gateway_demand({url: text for url, (text, _) in gateways.items()}, previous)


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
        self.gateway_counters: dict[str, float] = {}
        """The gateways' counters at this autoscaler's last scrape of them (gateway_demand)."""
        self.ticks: list[dict] = []
        """Per tick: the observation, the decision, the pool's counts."""

    def gateway_demand(self) -> GatewayDemand:
        demand, self.gateway_counters = scrape_gateway_demand(self.fetch, self.gateway_metrics_urls, self.clock,
                                                              self.gateway_counters)
        return demand

    def observe(self, demand: GatewayDemand | None = None) -> PoolObservation:
        """`demand`: this tick's scrape of the gateways; None: scrape them now (first, as the operator's
        tick scrapes them before the pools)."""
        if demand is None:
            demand = self.gateway_demand()
        ready = self.pool.in_state("ready")
        texts = _scrape_all(self.fetch, {p.handle.address: p.handle.metrics_url for p in ready}, self.clock)
        samples = {name: parse_pod_metrics(text, scraped_at=at) for name, (text, at) in texts.items()}
        signals = pool_signals(samples, self.memory, gateway_queued=demand.queued)
        self.memory = samples
        return PoolObservation(replicas=self.replicas, ready=len(ready), pending=len(self.pool.in_state("starting")),
                               signal=signals.value(self.policy.signal), busy=signals.busy,
                               gateway_queued=demand.queued, prefills_unplaced=demand.unplaced_for(self.pool.role))

    def tick(self, now: float, demand: GatewayDemand | None = None) -> Decision:
        obs = self.observe(demand)
        decision = decide(self.policy, obs, self.state, now)
        self.replicas = decision.replicas
        self.pool.scale_to(decision.replicas, now)
        self.ticks.append({"t": now, "asked": decision.replicas, "previous": decision.previous,
                           "reason": decision.reason, "message": decision.message, "signal": obs.signal,
                           "busy": obs.busy, "gateway_queued": obs.gateway_queued,
                           "prefills_unplaced": obs.prefills_unplaced, **self.pool.counts()})
        return decision


class ControlLoop(threading.Thread):
    """Every pool's lifecycle every `step_s`, and (with autoscalers) a tick
    every `interval_s` from the start: one scrape of the gateways, then each
    pool's decision; runs until `stop()`. An exception ends the loop and is
    raised again by `stop()`."""

    def __init__(self, pools: list[ElasticPool], autoscalers: list[Autoscaler], interval_s: float,
                 step_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name="fleet-autoscaler", daemon=True)
        self.pools, self.autoscalers = pools, autoscalers
        self.interval_s, self.step_s, self.clock = interval_s, step_s, clock
        self._stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        next_tick = self.clock()
        try:
            while not self._stop_event.is_set():
                now = self.clock()
                for pool in self.pools:
                    pool.step(now)
                if self.autoscalers and now >= next_tick:
                    self._tick(now)
                    next_tick += self.interval_s
                    if next_tick < now:  # a tick took longer than the interval: keep the period, skip the lost ones
                        next_tick = now + self.interval_s
                self._stop_event.wait(self.step_s)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by stop()
            self.error = e

    def _tick(self, now: float) -> None:
        demand = self.autoscalers[0].gateway_demand()  # every pool's autoscaler reads the same gateways
        for autoscaler in self.autoscalers:
            autoscaler.tick(now, demand)

    def stop(self) -> None:
        """Also safe on a loop never started (its run failed before the trace)."""
        self._stop_event.set()
        if self.ident is not None:
            self.join()
        if self.error is not None:
            raise RuntimeError(f"the autoscaler loop failed: {self.error!r}") from self.error
