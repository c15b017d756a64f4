"""The search: coordinate ascent over the knobs, not the full grid.

From the resource's own settings, each knob in turn is moved through its
values with the others held at the best found so far; along a knob the walk
stops once goodput has fallen twice in a row past its best (the curve of
goodput against a batching knob rises, then falls). A second pass over the
knobs runs only if the first changed more than one of them. Each setting is
run once: repeats are answered from the results so far."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tessera_tools.tune.knobs import Knob


@dataclass
class Trial:
    settings: dict[str, int]
    goodput: float
    """Requests/s meeting every SLO at the best rate the setting held its SLOs at (0: none)."""
    meets: bool
    """Held every SLO at some rate tried."""
    detail: dict = field(default_factory=dict)


Evaluate = Callable[[dict[str, int]], Trial]


def _key(settings: dict[str, int]) -> tuple:
    return tuple(sorted(settings.items()))


def _better(a: Trial, b: Trial | None) -> bool:
    return b is None or (a.meets, a.goodput) > (b.meets, b.goodput)


def search(knobs: list[Knob], start: dict[str, int], evaluate: Evaluate, max_passes: int = 2) -> list[Trial]:
    """Every trial run, in order; the best is max by (meets, goodput)."""
    seen: dict[tuple, Trial] = {}

    def run(settings: dict[str, int]) -> Trial:
        key = _key(settings)
        if key not in seen:
            seen[key] = evaluate(dict(settings))
        return seen[key]

    best = run(start)
    for _ in range(max_passes):
        changed = 0
        for knob in knobs:
            along: Trial | None = None
            falls = 0
            for value in knob.values:
                trial = run({**best.settings, knob.name: value})
                if _better(trial, along):
                    along, falls = trial, 0
                else:
                    falls += 1
                    if falls == 2:
                        break
            if along is not None and _better(along, best):
                best = along
                changed += 1
        if changed <= 1:
            break
    return list(seen.values())


def best_of(trials: list[Trial]) -> Trial:
    best = None
    for trial in trials:
        if _better(trial, best):
            best = trial
    assert best is not None
    return best
