"""The pure autoscaling decision of one engine pool.

Each pool (mixed, prefill, decode) is decided on its own signal, with the
Horizontal Pod Autoscaler's algorithm:

    ratio       = observed / target
    recommended = ceil(ready * ratio)          (kept at current when |ratio - 1| <= tolerance)
    clamped to [minReplicas, maxReplicas]

then stabilized: a scale-up goes to the lowest recommendation of the last
scaleUpStabilizationSeconds (0: at once), a scale-down only to the highest
of the last scaleDownStabilizationSeconds (scaleDownStabilization
"highest", the HPA's rule) or to the window's mean demand rounded up
("mean", Knative's stable window: the unrounded ready * ratio of each tick,
so one noisy tick above target does not hold the pool for a whole window). Steps are limited: up by
max(maxScaleUpStep, current) pods, down by maxScaleDownStep. Pending pods
freeze scale-down (capacity is still arriving); a pool at zero replicas is
lifted to max(1, minReplicas) as soon as the gateway holds requests for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessera_operator.crd_engine import DOWN_STABILIZATIONS, POOL_NAMES

TARGET_FIELDS = {"queue": "targetQueuePerReplica", "ttft": "targetTTFTSeconds",
                 "itl": "targetITLSeconds", "kvUsage": "targetKVUsage",
                 "concurrency": "targetConcurrencyPerReplica"}


@dataclass(frozen=True)
class ScalingPolicy:
    signal: str
    target: float
    min_replicas: int
    max_replicas: int
    tolerance: float = 0.1
    up_window_s: float = 0.0
    down_window_s: float = 300.0
    max_up_step: int = 4
    max_down_step: int = 1
    down_stabilization: str = "highest"
    """How a scale-down reads its window: "highest" recommendation, or "mean" demand."""

    def __post_init__(self) -> None:
        if self.down_stabilization not in DOWN_STABILIZATIONS:
            raise ValueError(f"down_stabilization {self.down_stabilization!r}: one of {', '.join(DOWN_STABILIZATIONS)}")

    @classmethod
    def from_spec(cls, spec: dict, role: str) -> ScalingPolicy:
        """From a defaulted InferenceService spec (see validate_inference_service)."""
        assert role in POOL_NAMES
        scaling, pool = spec["autoscaling"][role], spec["pools"][role]
        return cls(signal=scaling["signal"], target=float(scaling[TARGET_FIELDS[scaling["signal"]]]),
                   min_replicas=pool["minReplicas"], max_replicas=pool["maxReplicas"],
                   tolerance=scaling["tolerance"], up_window_s=scaling["scaleUpStabilizationSeconds"],
                   down_window_s=scaling["scaleDownStabilizationSeconds"],
                   max_up_step=scaling["maxScaleUpStep"], max_down_step=scaling["maxScaleDownStep"],
                   down_stabilization=scaling["scaleDownStabilization"])

    def bounded(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class PoolObservation:
    """What the operator saw of a pool at one tick."""

    replicas: int              # replicas the Deployment asks for now
    ready: int                 # pods passing readiness
    pending: int               # pods that exist but are not ready yet (scheduling, pulling, loading)
    signal: float | None       # the policy's signal; None when there were no samples this interval
    busy: bool                 # requests running or waiting on the pool's pods
    gateway_queued: int = 0    # requests the gateway holds for this pool (the only signal at zero pods)
    # A prefill pool's: prompts the gateways had a decode pod prefill since the last tick, for
    # want of a prefill pod. At zero prefill pods nothing queues (the decode pods serve), so this
    # is the demand that lifts the pool from zero.
    prefills_unplaced: int = 0


@dataclass
class ScalerState:
    """Recent recommendations (time, replicas, demand): the stabilization windows look back over them."""

    history: list[tuple[float, int, float]] = field(default_factory=list)
    since: float | None = None   # first tick seen; scale-down waits a whole window after it


@dataclass(frozen=True)
class Decision:
    previous: int
    replicas: int
    reason: str
    message: str

    @property
    def changed(self) -> bool:
        return self.replicas != self.previous


def recommend(policy: ScalingPolicy, obs: PoolObservation) -> tuple[int, str]:
    """The unstabilized recommendation and why."""
    replicas, _, why = _recommendation(policy, obs)
    return replicas, why


def _recommendation(policy: ScalingPolicy, obs: PoolObservation) -> tuple[int, float, str]:
    """The recommendation, the demand it rounds up (ready * ratio within the bounds: what the "mean"
    scale-down averages; the recommendation itself where it did not follow the ratio) and why."""
    def held(replicas: int, why: str) -> tuple[int, float, str]:
        return replicas, float(replicas), why

    if obs.signal is None:
        if not obs.busy and obs.gateway_queued == 0:
            return held(policy.bounded(0), "idle: no requests on the pool")
        return held(policy.bounded(obs.replicas), "no samples this interval")
    ratio = obs.signal / policy.target
    described = f"{policy.signal} {obs.signal:.3g} vs target {policy.target:.3g} (ratio {ratio:.2f})"
    if abs(ratio - 1.0) <= policy.tolerance:
        return held(policy.bounded(obs.replicas), f"{described}, within tolerance")
    # The epsilon keeps float noise (3.0000000000000004) from buying a pod.
    recommended = math.ceil(obs.ready * ratio - 1e-9)
    if obs.busy and recommended < 1:
        # A signal of 0 (an empty waiting queue) on a pool that is serving:
        # never to zero while requests run there (only idleness scales to zero).
        return held(policy.bounded(1), f"{described}, but requests are running")
    wanted = max(float(policy.min_replicas), min(float(policy.max_replicas), obs.ready * ratio))
    return policy.bounded(recommended), wanted, described


def decide(policy: ScalingPolicy, obs: PoolObservation, state: ScalerState, now: float) -> Decision:
    """Replicas for the pool now; updates `state`."""
    current = obs.replicas
    if state.since is None:
        # A fresh state (first tick, or an operator restart) has no history: scale-down then
        # waits a whole window, never acting on a short look at the metrics.
        state.since = now
    if policy.bounded(current) != current:
        return Decision(current, policy.bounded(current), "OutOfBounds",
                        f"{current} replicas outside [{policy.min_replicas}, {policy.max_replicas}]")
    if current == 0:
        return _from_zero(policy, obs, state, now)
    if obs.ready == 0:
        return _hold(policy, current, "WaitingForReadyPods", f"{obs.pending} pod(s) starting, none ready yet")
    raw, wanted, why = _recommendation(policy, obs)
    _remember(state, policy, now, raw, wanted)
    if raw > current:
        return _scale_up(policy, current, state, now, why)
    if raw < current:
        if obs.pending > 0:
            return _hold(policy, current, "PodsPending", f"{why}; {obs.pending} pod(s) pending, no scale-down")
        return _scale_down(policy, current, state, now, why)
    return _hold(policy, current, "Steady", why)


def _from_zero(policy: ScalingPolicy, obs: PoolObservation, state: ScalerState, now: float) -> Decision:
    if obs.gateway_queued > 0 or obs.prefills_unplaced > 0:
        replicas = policy.bounded(max(1, policy.min_replicas))
        _remember(state, policy, now, replicas, replicas)
        why = (f"{obs.gateway_queued} request(s) queued at the gateway" if obs.gateway_queued
               else f"{obs.prefills_unplaced} prompt(s) prefilled on decode pods for want of a prefill pod")
        return Decision(0, replicas, "ScaleFromZero", why)
    _remember(state, policy, now, 0, 0.0)
    return Decision(0, 0, "ScaledToZero", "no queued demand")


def _scale_up(policy: ScalingPolicy, current: int, state: ScalerState, now: float, why: str) -> Decision:
    stabilized = min(r for t, r, _ in state.history if t >= now - policy.up_window_s)
    limit = current + max(policy.max_up_step, current)
    replicas = policy.bounded(min(max(current, stabilized), limit))
    return Decision(current, replicas, "ScaleUp" if replicas > current else "UpStabilizing", why)


def _scale_down(policy: ScalingPolicy, current: int, state: ScalerState, now: float, why: str) -> Decision:
    if now - state.since < policy.down_window_s:
        return Decision(current, current, "DownStabilizing", f"{why}; first window since start")
    stabilized = _down_stabilized(policy, [e for e in state.history if e[0] >= now - policy.down_window_s])
    limit = current - policy.max_down_step
    replicas = policy.bounded(max(min(current, stabilized), limit))
    return Decision(current, replicas, "ScaleDown" if replicas < current else "DownStabilizing", why)


def _hold(policy: ScalingPolicy, current: int, reason: str, message: str) -> Decision:
    # Bounds still apply: a spec edit of min/max takes effect even while holding.
    return Decision(current, policy.bounded(current), reason, message)


def _down_stabilized(policy: ScalingPolicy, window: list[tuple[float, int, float]]) -> int:
    """The fewest replicas a scale-down may go to over the window's recommendations."""
    if policy.down_stabilization == "mean":
        mean = sum(d for _, _, d in window) / len(window)
        # Never below this tick's own recommendation (the last entry): it keeps a busy pool at a pod.
        return max(math.ceil(mean - 1e-9), window[-1][1])
    return max(r for _, r, _ in window)


def _remember(state: ScalerState, policy: ScalingPolicy, now: float, replicas: int, wanted: float) -> None:
    state.history.append((now, replicas, wanted))
    horizon = now - max(policy.up_window_s, policy.down_window_s)
    state.history[:] = [e for e in state.history if e[0] >= horizon]
