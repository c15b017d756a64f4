"""Per-step scheduler statistics (the inputs of the pod's metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_pod.spec_decode.metrics import SpecDecodeStats


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_free: int = 0
    kv_cache_usage: float = 0.0
    # Since the previous step, in tokens.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Allocated KV slots of running requests minus the slots they have filled.
    kv_waste_slots: int = 0
    # Prompt tokens loaded from the KV store instead of computed.
    external_prefix_hits: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)


@dataclass
class EngineTotals:
    """Running totals over the engine's life, accumulated from step stats."""

    steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    max_kv_waste_slots: int = 0
    max_kv_waste_per_request: float = 0.0
    external_prefix_hits: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    def add(self, stats: SchedulerStats) -> None:
        self.steps += 1
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.num_preemptions += stats.num_preemptions
        self.external_prefix_hits += stats.external_prefix_hits
        self.spec_decode.add(stats.spec_decode)
        self.max_kv_waste_slots = max(self.max_kv_waste_slots, stats.kv_waste_slots)
        if stats.num_running_reqs:
            per_req = stats.kv_waste_slots / stats.num_running_reqs
            self.max_kv_waste_per_request = max(self.max_kv_waste_per_request, per_req)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
