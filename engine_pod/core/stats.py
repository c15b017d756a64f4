"""Per-step scheduler statistics (the inputs of the pod's metrics), with the
speculative-decoding counters they carry."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counters of drafting and verification (vLLM's spec_decode metrics)."""

    # Verification steps of one request that carried at least one draft.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    def add(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens

    def take(self) -> SpecDecodeStats:
        """The counts so far, resetting them (one step's worth)."""
        out = SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: the accepted drafts plus the
        one token the target model always adds (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Of those, background requests (SchedulerConfig.background_priority).
    num_background_running: int = 0
    num_background_waiting: int = 0
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
    # Model steps whose output this engine step applied: 1, or under pipeline parallelism 0 when it
    # only submitted one.
    steps_done: int = 1
    # Steps submitted and not yet applied after it (above 0 only under pipeline parallelism).
    steps_in_flight: int = 0


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
    # The most steps ever in flight at once, counting one being submitted (pipeline parallelism).
    max_steps_in_flight: int = 0

    def add(self, stats: SchedulerStats) -> None:
        self.steps += stats.steps_done
        self.max_steps_in_flight = max(self.max_steps_in_flight, stats.steps_in_flight + stats.steps_done)
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
