"""The autoscaler's decision on synthetic metric traces, tick by tick (15 s apart).

A pool is simulated: pods take `startup_ticks` to become ready, and the
observed signal is proportional to each ready pod's share of the load
(signal == target exactly when load per pod == `capacity`). Every trace
states its bound on replica changes, so flapping fails it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest

from tessera_operator.autoscale import PoolObservation, ScalerState, ScalingPolicy, decide, recommend
from tessera_operator.reconcile import validated

from .conftest import make_isvc

TICK_S = 15.0


@dataclass
class SimPool:
    policy: ScalingPolicy
    capacity: float                 # load one pod carries at exactly the target
    replicas: int
    startup_ticks: int = 2
    ready: int = 0
    starting: list[int] = field(default_factory=list)
    state: ScalerState = field(default_factory=ScalerState)
    history: list[int] = field(default_factory=list)
    pending_seen: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.ready = self.replicas

    def signal(self, load: float) -> float | None:
        if self.ready == 0 or load <= 0:
            return 0.0 if self.ready else None
        return self.policy.target * load / (self.ready * self.capacity)

    def tick(self, t: int, load: float, gateway_queued: int = 0) -> None:
        obs = PoolObservation(replicas=self.replicas, ready=self.ready, pending=len(self.starting),
                              signal=self.signal(load), busy=load > 0, gateway_queued=gateway_queued)
        decision = decide(self.policy, obs, self.state, t * TICK_S)
        self.pending_seen.append(len(self.starting))
        self.reasons.append(decision.reason)
        self.replicas = decision.replicas
        self._converge()
        self.history.append(self.replicas)

    def _converge(self) -> None:
        self.starting = [n - 1 for n in self.starting]
        self.ready += sum(1 for n in self.starting if n <= 0)
        self.starting = [n for n in self.starting if n > 0]
        while self.ready + len(self.starting) < self.replicas:
            self.starting.append(self.startup_ticks)
        while self.ready + len(self.starting) > self.replicas:
            if self.starting:
                self.starting.pop()
            else:
                self.ready -= 1


def run(pool: SimPool, trace: list[float], queued: list[int] | None = None) -> list[int]:
    for t, load in enumerate(trace):
        pool.tick(t, load, queued[t] if queued else 0)
    return pool.history


def changes(history: list[int], start: int) -> int:
    seq = [start] + history
    return sum(1 for a, b in zip(seq, seq[1:]) if a != b)


def reversals(history: list[int]) -> int:
    """Up-then-down or down-then-up turns: the flapping count."""
    steps = [b - a for a, b in zip(history, history[1:]) if b != a]
    return sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0))


def policy(**kw) -> ScalingPolicy:
    base = dict(signal="queue", target=4.0, min_replicas=1, max_replicas=10, tolerance=0.1,
                up_window_s=0, down_window_s=300, max_up_step=4, max_down_step=1)
    return ScalingPolicy(**{**base, **kw})


def ramp(start, end, n):
    return [start + (end - start) * i / (n - 1) for i in range(n)]


def test_ramp_scales_up_monotonically_to_the_load():
    pool = SimPool(policy(), capacity=1.0, replicas=1)
    history = run(pool, ramp(1, 8, 40) + [8] * 40)
    assert all(1 <= r <= 10 for r in history)
    assert history == sorted(history), "a rising load never scales down"
    assert history[-1] == 8
    assert changes(history, 1) <= 8


def test_spike_up_fast_down_after_the_window_without_flapping():
    pool = SimPool(policy(), capacity=1.0, replicas=2)
    trace = [2] * 10 + [9] * 8 + [2] * 60
    history = run(pool, trace)
    assert all(1 <= r <= 10 for r in history)
    assert max(history[10:13]) >= 6, "reaches most of the spike's need within 3 ticks"
    last_high = max(i for i, load in enumerate(trace) if load == 9)
    first_down = next(i for i in range(last_high, len(history)) if history[i] < history[i - 1])
    assert (first_down - last_high) * TICK_S >= 300, "scale-down waits out the stabilization window"
    assert history[-1] == 2
    assert reversals(history) == 1  # up, then down: once
    assert changes(history, 2) <= 3 + 8


def test_decay_steps_down_one_pod_at_a_time_after_the_window():
    pool = SimPool(policy(), capacity=1.0, replicas=8)
    trace = [8 * math.exp(-i / 15) for i in range(120)]
    history = run(pool, trace)
    assert history == sorted(history, reverse=True), "a falling load never scales up"
    assert history[:20] == [8] * 20, "no scale-down during the first window after start"
    assert all(a - b <= 1 for a, b in zip(history, history[1:]))
    assert history[-1] == 1
    assert changes(history, 8) <= 7


def _noisy_steady(stabilization: str) -> list[int]:
    """A pool of 12 under a load needing 3 pods, every third tick a burst needing 5; the up
    window (two ticks) passes over a single burst."""
    pool = SimPool(policy(max_replicas=12, up_window_s=30, down_stabilization=stabilization), capacity=1.0,
                   replicas=12)
    return run(pool, [5.0 if t % 3 == 2 else 3.0 for t in range(90)])


def test_a_scale_down_on_the_window_mean_is_not_held_by_single_noisy_ticks():
    highest, mean = _noisy_steady("highest"), _noisy_steady("mean")
    # The HPA's rule holds the pool at every window's burst (5 pods); the mean demand, (3 + 3 + 5) / 3
    # rounded up, is 4. Both descend without flapping.
    assert highest[-30:] == [5] * 30 and mean[-30:] == [4] * 30
    for history in (highest, mean):
        assert history == sorted(history, reverse=True) and history[:20] == [12] * 20


def test_the_mean_never_goes_below_this_ticks_recommendation():
    p = policy(max_replicas=12, down_window_s=60, max_down_step=10, down_stabilization="mean")
    state = ScalerState(since=0.0)
    for t in range(4):  # four quiet ticks: a demand of 1 pod each
        decide(p, PoolObservation(replicas=8, ready=8, pending=0, signal=0.5, busy=True), state, 15.0 * t)
    # Now 4 pods' worth: the window's mean is (1 + 1 + 1 + 4) / 4 = 1.75, this tick's 4.
    decision = decide(p, PoolObservation(replicas=8, ready=8, pending=0, signal=2.0, busy=True), state, 75.0)
    assert (decision.replicas, decision.reason) == (4, "ScaleDown")


def test_an_unknown_scale_down_rule_is_refused():
    with pytest.raises(ValueError, match="down_stabilization 'lowest': one of highest, mean"):
        policy(down_stabilization="lowest")


def _pd_pools():
    prefill = SimPool(policy(signal="ttft", target=1.0, max_replicas=6), capacity=2.0, replicas=1)
    decode = SimPool(policy(signal="kvUsage", target=0.8, max_replicas=6), capacity=2.0, replicas=1)
    return prefill, decode


def test_prefill_heavy_moves_only_prefill():
    prefill, decode = _pd_pools()
    run(prefill, [1] * 5 + [8] * 40)   # long prompts: prefill time dominates
    run(decode, [1.5] * 45)             # short outputs: decode stays near its target
    assert prefill.history[-1] == 4 and decode.history == [1] * 45
    assert reversals(prefill.history) == 0 and changes(prefill.history, 1) <= 3


def test_decode_heavy_moves_only_decode():
    prefill, decode = _pd_pools()
    run(prefill, [1.5] * 45)
    run(decode, [1] * 5 + [10] * 40)
    assert decode.history[-1] == 5 and prefill.history == [1] * 45
    assert reversals(decode.history) == 0 and changes(decode.history, 1) <= 3


def test_bounds_hold_under_extreme_load():
    pool = SimPool(policy(min_replicas=2, max_replicas=5), capacity=1.0, replicas=2)
    history = run(pool, [100] * 20 + [0] * 60)
    assert max(history) == 5 and min(history) == 2
    assert all(2 <= r <= 5 for r in history)


def test_pending_pods_block_scale_down():
    pool = SimPool(policy(down_window_s=0), capacity=1.0, replicas=2, startup_ticks=12)
    trace = [8] * 2 + [0.5] * 30
    history = run(pool, trace)
    for t in range(2, 30):
        if pool.pending_seen[t] > 0:
            assert history[t] >= history[t - 1], f"scaled down at tick {t} with pods pending"
    assert "PodsPending" in pool.reasons
    assert history[-1] == 1, "once the pods are up, the idle pool does shrink"


def test_queued_demand_lifts_a_pool_from_zero():
    pool = SimPool(policy(min_replicas=0, down_window_s=60), capacity=1.0, replicas=0)
    queued = [0] * 5 + [3] * 3 + [0] * 40
    trace = [0] * 5 + [1] * 10 + [0] * 33
    history = run(pool, trace, queued)
    assert history[:5] == [0] * 5, "no demand, no pods"
    assert history[5] == 1 and pool.reasons[5] == "ScaleFromZero"
    assert history[-1] == 0, "idle again: back to zero after the window"
    assert reversals(history) == 1


def test_prompts_prefilled_for_want_of_a_prefill_pod_lift_the_prefill_pool_from_zero():
    p = policy(min_replicas=0, max_replicas=3)
    at_zero = PoolObservation(replicas=0, ready=0, pending=0, signal=None, busy=False)
    assert decide(p, at_zero, ScalerState(), 0.0).reason == "ScaledToZero"
    lifted = decide(p, dataclasses.replace(at_zero, prefills_unplaced=2), ScalerState(), 0.0)
    assert (lifted.reason, lifted.replicas) == ("ScaleFromZero", 1)
    assert lifted.message == "2 prompt(s) prefilled on decode pods for want of a prefill pod"


def test_scale_from_zero_respects_min_and_max():
    p = policy(min_replicas=0, max_replicas=3)
    obs = PoolObservation(replicas=0, ready=0, pending=0, signal=None, busy=False, gateway_queued=50)
    assert decide(p, obs, ScalerState(), 0.0).replicas == 1
    idle = PoolObservation(replicas=0, ready=0, pending=0, signal=None, busy=False)
    assert decide(p, idle, ScalerState(), 0.0).replicas == 0


def test_concurrency_recommends_in_proportion_to_the_requests_in_flight():
    p = policy(signal="concurrency", target=8.0)
    obs = PoolObservation(replicas=2, ready=2, pending=0, signal=16.0, busy=True)
    assert recommend(p, obs) == (4, "concurrency 16 vs target 8 (ratio 2.00)")  # ceil(2 x 16/8)
    assert decide(p, obs, ScalerState(), 0.0).replicas == 4
    # Demand queued at the gateway counts before any pod runs it: no running requests, still up.
    queued = PoolObservation(replicas=1, ready=1, pending=0, signal=20.0, busy=False, gateway_queued=20)
    assert recommend(p, queued)[0] == 3


def test_tolerance_band_holds_replicas():
    p = policy(tolerance=0.1)
    obs = PoolObservation(replicas=4, ready=4, pending=0, signal=4.3, busy=True)
    assert recommend(p, obs)[0] == 4
    assert recommend(p, PoolObservation(replicas=4, ready=4, pending=0, signal=5.0, busy=True))[0] == 5


def test_scale_up_step_is_limited_to_doubling_or_max_step():
    p = policy(max_replicas=100, max_up_step=4)
    obs = PoolObservation(replicas=2, ready=2, pending=0, signal=400.0, busy=True)
    assert decide(p, obs, ScalerState(), 0.0).replicas == 6
    obs = PoolObservation(replicas=10, ready=10, pending=0, signal=400.0, busy=True)
    assert decide(p, obs, ScalerState(), 0.0).replicas == 20


def test_no_samples_while_busy_holds_and_idle_shrinks_after_window():
    p = policy(down_window_s=60)
    state = ScalerState()
    busy = PoolObservation(replicas=3, ready=3, pending=0, signal=None, busy=True)
    assert decide(p, busy, state, 0.0).replicas == 3
    idle = PoolObservation(replicas=3, ready=3, pending=0, signal=None, busy=False)
    assert decide(p, idle, state, 30.0).replicas == 3  # still inside the window
    assert decide(p, idle, state, 61.0).replicas == 2


def test_a_serving_pool_with_an_empty_queue_is_not_scaled_to_zero():
    """The queue signal reads 0 while a pod admits every request into its
    batch: with minReplicas 0 that recommended 0 pods for a pool serving
    requests (found by `tessera bench fleet --scenario autoscale`)."""
    p = policy(min_replicas=0, down_window_s=0)
    state = ScalerState()
    busy = PoolObservation(replicas=2, ready=2, pending=0, signal=0.0, busy=True)
    assert recommend(p, busy)[0] == 1
    assert decide(p, busy, state, 0.0).replicas >= 1
    assert decide(p, busy, state, 100.0).replicas >= 1
    idle = PoolObservation(replicas=1, ready=1, pending=0, signal=None, busy=False)
    assert recommend(p, idle)[0] == 0  # idleness still scales to zero


def test_spec_bound_change_applies_at_once():
    p = policy(min_replicas=1, max_replicas=3)
    obs = PoolObservation(replicas=6, ready=6, pending=0, signal=4.0, busy=True)
    decision = decide(p, obs, ScalerState(), 0.0)
    assert (decision.replicas, decision.reason) == (3, "OutOfBounds")


def test_policy_from_spec():
    spec = validated(make_isvc({"mode": "disaggregated", "pools": {"decode": {"minReplicas": 2, "maxReplicas": 9}},
                                "autoscaling": {"decode": {"signal": "itl", "targetITLSeconds": 0.03,
                                                           "scaleDownStabilizationSeconds": 600}}}))["spec"]
    p = ScalingPolicy.from_spec(spec, "decode")
    assert (p.signal, p.target, p.min_replicas, p.max_replicas, p.down_window_s) == ("itl", 0.03, 2, 9, 600)
    assert p.down_stabilization == "highest"  # the CRD's default: the HPA's rule
    prefill = ScalingPolicy.from_spec(spec, "prefill")
    assert (prefill.signal, prefill.target) == ("concurrency", 8.0)


@pytest.mark.parametrize("role", ["mixed", "prefill", "decode"])
def test_policy_from_spec_on_concurrency(role):
    mode = "mixed" if role == "mixed" else "disaggregated"
    spec = validated(make_isvc({"mode": mode, "autoscaling": {role: {"signal": "concurrency"}}}))["spec"]
    p = ScalingPolicy.from_spec(spec, role)
    assert (p.signal, p.target) == ("concurrency", 8.0)  # the CRD's default target
    spec = validated(make_isvc({"mode": mode, "autoscaling": {role: {"signal": "concurrency",
                                                                     "targetConcurrencyPerReplica": 24}}}))["spec"]
    assert ScalingPolicy.from_spec(spec, role).target == 24.0


@pytest.mark.parametrize("signal,target", [("queue", 4.0), ("ttft", 1.0), ("itl", 0.05), ("kvUsage", 0.8),
                                           ("concurrency", 8.0)])
def test_every_signal_scales_the_same_way(signal, target):
    pool = SimPool(policy(signal=signal, target=target), capacity=1.0, replicas=1)
    history = run(pool, [3] * 10)
    assert history[-1] == 3
