"""The settings a tuning run searches, by their names in the resource, each
with the values to try: the engine's scheduling knobs (`spec.engine`) and,
for a disaggregated service, the sizes of its prefill and decode pools
(`spec.pools.prefill.replicas`, `spec.pools.decode.replicas`: their ratio is
what the search moves)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

# Each knob: where it lives in the resource, its default candidates, and the mode it needs (None: any).
KNOWN: dict[str, tuple[tuple[str, ...], tuple[int, ...], str | None]] = {
    "maxNumSeqs": (("engine", "maxNumSeqs"), (8, 32, 128), None),
    "maxNumBatchedTokens": (("engine", "maxNumBatchedTokens"), (512, 1024, 2048, 4096), None),
    "prefillReplicas": (("pools", "prefill", "replicas"), (1, 2, 3), "disaggregated"),
    "decodeReplicas": (("pools", "decode", "replicas"), (1, 2, 3), "disaggregated"),
}


@dataclass(frozen=True)
class Knob:
    name: str
    """maxNumSeqs, maxNumBatchedTokens (spec.engine), prefillReplicas or decodeReplicas (spec.pools)."""
    values: tuple[int, ...]
    """Ascending candidates."""

    @property
    def path(self) -> tuple[str, ...]:
        """Its place under spec."""
        return KNOWN[self.name][0]


def parse_knob(text: str) -> Knob:
    """"maxNumSeqs=8,16,32" -> Knob("maxNumSeqs", (8, 16, 32)); "maxNumSeqs" alone takes KNOWN's values."""
    name, sep, values = text.partition("=")
    if name not in KNOWN:
        raise ValueError(f"knob {name!r}: not one this tuner searches (known: {', '.join(KNOWN)})")
    if not sep:
        return Knob(name, KNOWN[name][1])
    try:
        parsed = sorted({int(v) for v in values.split(",")})
    except ValueError:
        raise ValueError(f"knob {text!r}: expected NAME=INT,INT,...") from None
    if not parsed or parsed[0] < 1:
        raise ValueError(f"knob {text!r}: values must be positive integers")
    return Knob(name, tuple(parsed))


def default_knobs(mode: str) -> list[Knob]:
    """What a run searches without --knob: every knob the service's mode has."""
    return [Knob(name, values) for name, (_, values, needs) in KNOWN.items() if needs in (None, mode)]


def check_mode(knobs: list[Knob], mode: str) -> None:
    for knob in knobs:
        needs = KNOWN[knob.name][2]
        if needs is not None and needs != mode:
            raise ValueError(f"knob {knob.name}: only a {needs} service has it (spec.mode is {mode})")


def current(spec: dict, knob: Knob) -> int:
    """The knob's value in a validated spec (defaults applied)."""
    value = spec
    for key in knob.path:
        value = value[key]
    return value


def with_settings(resource: dict, settings: dict[str, int]) -> dict:
    """A copy of the resource with `settings` (knob name -> value) in place."""
    out = copy.deepcopy(resource)
    spec = out.setdefault("spec", {})
    for name, value in settings.items():
        *parents, leaf = KNOWN[name][0]
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out
