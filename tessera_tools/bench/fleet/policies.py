"""The routing policies the fleet benchmark compares, as gateway `router`
sections: ONE table, so a renamed gateway knob is fixed in one place.

Each entry says how it maps to the gateway (the report repeats it), above
all where the gateway has no such policy and the closest honest config
stands in.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Policy:
    """A policy as the benchmark names it and as the gateway is configured for it."""

    router: dict = field(default_factory=dict)
    """The gateway config's `router` section (gateway/config.py RouterConfig)."""
    note: str = ""
    """How the name maps to the gateway, for the report."""


POLICIES: dict[str, Policy] = {
    "round_robin": Policy({"policy": "round_robin"}, "gateway policy round_robin: no prefix queries, no load"),
    "least_loaded": Policy(
        {"policy": "bounded", "affinity_candidates": 0, "load_candidates": 1},
        "the gateway has no least-loaded policy: stands in bounded with 0 affinity and 1 load candidate, i.e. the "
        "least loaded pod by pushed reports (ties broken by a rendezvous hash of the prompt's first block). It "
        "still sends that one pod a prefix query per request (not used for the choice)"),
    "score": Policy({"policy": "score", "prefix_query_timeout_ms": 50},
                    "gateway policy score: asks EVERY pod its prefix match per request, 50 ms timeout"),
    "bounded_query": Policy({"policy": "bounded", "affinity_candidates": 2, "load_candidates": 2},
                            "gateway policy bounded, prefix_match query: asks 2 affinity (hash ring) + 2 "
                            "least-loaded pods per request"),
    "bounded": Policy({"policy": "bounded", "affinity_candidates": 2, "load_candidates": 2,
                       "holder_candidates": 2, "prefix_match": "pushed"},
                      "gateway policy bounded, prefix_match pushed: scores 2 affinity (hash ring) + 2 holders of "
                      "the longest cached prefix + 2 least-loaded pods from what the pods push on their load "
                      "streams; no prefix query per request"),
    "oracle": Policy({"policy": "score", "prefix_match": "pushed"},
                     "gateway policy score, prefix_match pushed: scores EVERY pod on its whole cache as the pod "
                     "pushed it (at most one 200 ms load report old), with no RPC per request; its hit rate is "
                     "the ceiling, its CPU per request grows with the fleet"),
}


def parse_policies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if not names or unknown:
        raise ValueError(f"policies {text!r}: expected names from {', '.join(POLICIES)}")
    return names
