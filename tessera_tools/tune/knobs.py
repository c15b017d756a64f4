"""The settings a tuning run searches: InferenceService fields of
`spec.engine`, by their names in the resource, each with the values to try."""

from __future__ import annotations

from dataclasses import dataclass

# The engine's scheduling knobs (operator/tessera_operator/crd_engine.py), each with its
# default candidates around the CRD's defaults.
KNOWN = {
    "maxNumSeqs": (8, 32, 128),
    "maxNumBatchedTokens": (512, 1024, 2048, 4096),
}


@dataclass(frozen=True)
class Knob:
    name: str
    """The field of spec.engine (maxNumSeqs, maxNumBatchedTokens)."""
    values: tuple[int, ...]
    """Ascending candidates."""


def parse_knob(text: str) -> Knob:
    """"maxNumSeqs=8,16,32" -> Knob("maxNumSeqs", (8, 16, 32)); "maxNumSeqs" alone takes KNOWN's values."""
    name, sep, values = text.partition("=")
    if name not in KNOWN:
        raise ValueError(f"knob {name!r}: not one this tuner searches (known: {', '.join(KNOWN)})")
    if not sep:
        return Knob(name, KNOWN[name])
    try:
        parsed = sorted({int(v) for v in values.split(",")})
    except ValueError:
        raise ValueError(f"knob {text!r}: expected NAME=INT,INT,...") from None
    if not parsed or parsed[0] < 1:
        raise ValueError(f"knob {text!r}: values must be positive integers")
    return Knob(name, tuple(parsed))


def with_settings(resource: dict, settings: dict[str, int]) -> dict:
    """A copy of the resource with `settings` in its spec.engine."""
    spec = dict(resource.get("spec") or {})
    spec["engine"] = {**(spec.get("engine") or {}), **settings}
    return {**resource, "spec": spec}
