"""What a fleet size's runs share: its workload spec (tenants scale with the
fleet), its trace (offered load as a fraction of the profile's capacity
estimate) and its requests, built once so every policy and gateway count
gets the same ones."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_pod.sim.step_profile import StepTimeProfile
from tessera_tools.bench.fleet.capacity import Capacity, estimate_capacity
from tessera_tools.bench.fleet.trace import build_trace, default_phases, phase_summary
from tessera_tools.bench.fleet.workload import (
    FleetRequest,
    WorkloadSpec,
    build_requests,
    shared_prefix_requests,
    system_prompts,
)


@dataclass(frozen=True)
class LoadSettings:
    """The flags that shape each fleet size's trace."""

    duration_s: float
    load: float
    """Steady-state offered load, a fraction of the fleet's estimated capacity."""
    rate: float | None
    """Steady-state requests/s instead of `load` (None: use `load`)."""
    burstiness: float
    spike_factor: float
    seed: int


@dataclass(frozen=True)
class PDPools:
    """A disaggregated fleet's pools, which a trace is sized for instead of mixed pods."""

    prefill: int
    decode: int


def _fleet_rps(capacity: Capacity, pods: int, pd: PDPools | None) -> float:
    return capacity.fleet_rps(pods) if pd is None else capacity.disaggregated_fleet_rps(pd.prefill, pd.decode)


@dataclass
class FleetSizePlan:
    pods: int
    spec: WorkloadSpec
    capacity: Capacity
    steady_rate: float
    offsets: list[float]
    trace: list[dict]
    requests: dict[str, list[FleetRequest]] = field(default_factory=dict)
    pd: PDPools | None = None
    """Sized for these pools (`pods` their sum); None: for `pods` mixed pods."""

    def fleet_rps(self) -> float:
        """The capacity estimate that `--load` is a fraction of."""
        return _fleet_rps(self.capacity, self.pods, self.pd)

    def as_dict(self) -> dict:
        shared = self.requests.get("shared-prefix", [])
        return {"pods": self.pods, "tenants": self.spec.tenants, "capacity": self.capacity.as_dict(),
                "sized_for": ({"prefill": self.pd.prefill, "decode": self.pd.decode} if self.pd
                              else {"mixed": self.pods}),
                "fleet_capacity_rps": self.fleet_rps(), "steady_rate_rps": self.steady_rate,
                "offered_load": self.steady_rate / self.fleet_rps(),
                "requests": len(self.offsets),
                "conversations": len({r.conversation for r in shared}) if shared else None,
                "phases": self.trace}


def _lengths(requests: list[FleetRequest]) -> list[tuple[int, int]]:
    return [(len(r.prompt_token_ids), r.output_len) for r in requests]


def _capacity(profile: StepTimeProfile, spec: WorkloadSpec, pods: int, load: LoadSettings,
              pd: PDPools | None) -> Capacity:
    """Capacity depends on the prompts, and they on the trace (conversations
    grow with the time between arrivals): a first estimate from first turns
    alone, then one from a pilot workload on the trace that estimate gives."""
    mean_user, mean_output = sum(spec.user_len) / 2, sum(spec.output_len) / 2
    first = estimate_capacity(profile, [(len(s) + int(mean_user), int(mean_output))
                                        for s in system_prompts(spec, load.seed)])
    rate = load.rate or load.load * _fleet_rps(first, pods, pd)
    pilot = build_trace(default_phases(load.duration_s, rate, load.spike_factor), load.burstiness, load.seed)
    return estimate_capacity(profile, _lengths(shared_prefix_requests(spec, pilot, load.seed)))


def plan_fleet_size(profile: StepTimeProfile, spec: WorkloadSpec, pods: int, load: LoadSettings,
                    workloads: list[str], pd: PDPools | None = None) -> FleetSizePlan:
    """`pd`: size the trace for these prefill and decode pools (their sum is `pods`)."""
    if pd is not None and pd.prefill + pd.decode != pods:
        raise ValueError(f"{pd.prefill} prefill + {pd.decode} decode pods are not {pods}")
    capacity = _capacity(profile, spec, pods, load, pd)
    rate = load.rate or load.load * _fleet_rps(capacity, pods, pd)
    phases = default_phases(load.duration_s, rate, load.spike_factor)
    offsets = build_trace(phases, load.burstiness, load.seed)
    plan = FleetSizePlan(pods, spec, capacity, rate, offsets, phase_summary(phases, offsets), pd=pd)
    for name in workloads:
        plan.requests[name] = build_requests(name, spec, offsets, load.seed)
    return plan
