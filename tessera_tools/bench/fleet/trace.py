"""When the fleet benchmark's requests arrive: a ramp, a steady part and a
spike, each phase a seeded Poisson or gamma process (serve's
`arrival_offsets`) at its own rate.

The default shape, as fractions of the duration and of the steady rate:

    ramp    0.0-0.2   stairs at 1/4, 2/4, 3/4, 4/4 of the rate
    steady  0.2-0.6   the rate
    spike   0.6-0.7   2x the rate
    steady  0.7-1.0   the rate (recovery after the spike)

One trace serves every policy at a fleet size, so they all see the same
arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera_tools.bench.serve.arrivals import arrival_offsets

RAMP_STEPS = 4
RAMP_END = 0.2
SPIKE_START, SPIKE_END = 0.6, 0.7


@dataclass(frozen=True)
class TracePhase:
    """A stretch of the trace with one arrival rate."""

    name: str
    """"ramp", "steady" or "spike"."""
    start_s: float
    """Offset of the phase's start from the run's start."""
    end_s: float
    """Offset of its end (exclusive)."""
    rate: float
    """Mean arrivals per second within the phase."""

    @property
    def expected_requests(self) -> float:
        return self.rate * (self.end_s - self.start_s)


def default_phases(duration_s: float, rate: float, spike_factor: float = 2.0) -> list[TracePhase]:
    """The ramp / steady / spike / steady shape of the module docstring."""
    if not duration_s > 0 or not rate > 0 or not spike_factor > 0:
        raise ValueError(f"duration, rate and spike factor must be > 0, got {duration_s}, {rate}, {spike_factor}")
    step = RAMP_END * duration_s / RAMP_STEPS
    phases = [TracePhase("ramp", i * step, (i + 1) * step, rate * (i + 1) / RAMP_STEPS) for i in range(RAMP_STEPS)]
    phases += [
        TracePhase("steady", RAMP_END * duration_s, SPIKE_START * duration_s, rate),
        TracePhase("spike", SPIKE_START * duration_s, SPIKE_END * duration_s, rate * spike_factor),
        TracePhase("steady", SPIKE_END * duration_s, duration_s, rate),
    ]
    return phases


def _phase_offsets(phase: TracePhase, burstiness: float, seed: int) -> list[float]:
    """The phase's arrivals, from its start. `arrival_offsets` puts its first
    arrival at 0; dropping it leaves a process that starts afresh at the
    phase's start (the first gap is drawn like the others). Seeded draws
    are a prefix of a longer sequence, so asking for more never changes the
    ones already drawn."""
    length = phase.end_s - phase.start_s
    count = int(phase.expected_requests * 1.5) + 20
    while True:
        offsets = arrival_offsets(count + 1, phase.rate, burstiness, seed)[1:]
        if offsets[-1] >= length:
            return [phase.start_s + t for t in offsets if t < length]
        count *= 2


def build_trace(phases: list[TracePhase], burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Every arrival of the trace, in order (seconds from the start)."""
    offsets: list[float] = []
    for i, phase in enumerate(phases):
        offsets += _phase_offsets(phase, burstiness, seed * 1000 + i)
    return offsets


def phase_summary(phases: list[TracePhase], offsets: list[float]) -> list[dict]:
    """Each phase with the arrivals it got, for the report."""
    return [{"name": p.name, "start_s": p.start_s, "end_s": p.end_s, "rate": p.rate,
             "requests": sum(p.start_s <= t < p.end_s for t in offsets)} for p in phases]
