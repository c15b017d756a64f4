"""One engine pod as the gateway sees it: a channel, its last load report,
and whether it is routable."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import grpc

from tessera.lora import LORA_NAME_RE
from gateway.hash_ring import ring_position
from gateway.pods.deadline import ProgressDeadline
from tessera.internal_channel import InternalClient
from tessera.v1 import engine_pb2 as epb
from tessera.v1 import engine_pb2_grpc as epb_grpc

# The most LoRA adapters believed of one pod's report: names become metric
# labels and /v1/models entries, so a faulty pod must not flood them.
MAX_REPORTED_ADAPTERS = 1024

# gRPC channel options for a long-lived loopback/cluster connection: fail
# fast when the pod is gone instead of waiting for reconnect back-off.
_CHANNEL_OPTIONS = [
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
]


def sanitized(report: epb.LoadReport) -> epb.LoadReport:
    """The report with every load figure clamped to what an honest pod can
    send, in place: counts at least 0, KV usage in [0, 1] (NaN as full).
    A faulty or hostile pod must not look better than idle and draw every
    request; one claiming to be busier than it is only hurts itself. Every
    report entering the gateway, pushed or answered, passes here once."""
    report.num_running = max(0, report.num_running)
    report.num_waiting = max(0, report.num_waiting)
    report.num_pending_prefill_tokens = max(0, report.num_pending_prefill_tokens)
    report.matched_prefix_blocks = max(0, report.matched_prefix_blocks)
    usage = report.kv_cache_usage
    report.kv_cache_usage = 1.0 if math.isnan(usage) else min(1.0, max(0.0, usage))
    return report


@dataclass
class Pod:
    address: str
    role: str
    # The internal token (and TLS) every call on the channel carries; None
    # only in unit tests that never dial (a pod refuses such calls).
    client: InternalClient | None = field(default=None, repr=False)
    channel: grpc.aio.Channel = field(init=False, repr=False)
    stub: epb_grpc.EngineStub = field(init=False, repr=False)
    # The last load report (None until the first one arrives).
    load: epb.LoadReport | None = None
    load_time: float = 0.0
    # Requests this gateway sent since the last report: the report cannot
    # count them yet, the score must.
    dispatched_since_report: int = 0
    # Progress deadlines of this gateway's Generate calls running on the pod
    # now (gateway/pods/deadline.py): the pool expires them if the pod stalls.
    calls: set[ProgressDeadline] = field(default_factory=set, repr=False)
    # False while ejected (connection lost, failed calls) until a report arrives.
    healthy: bool = False
    # The LoRA adapters the pod serves, by name, as of its last report (or the
    # answer to this gateway's last adapter load/unload on it, whichever is later).
    adapters: dict[str, epb.LoRAAdapter] = field(default_factory=dict, repr=False)

    # A 64-bit hash of the address: the bounded router's order among equally loaded pods.
    address_hash: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.address_hash = ring_position(self.address.encode())
        self.channel = (self.client.aio_channel(self.address, _CHANNEL_OPTIONS) if self.client is not None
                        else grpc.aio.insecure_channel(self.address, options=_CHANNEL_OPTIONS))
        self.stub = epb_grpc.EngineStub(self.channel)

    @property
    def routable(self) -> bool:
        # A stalled pod (its engine loop wedged in one step) answers reports but serves nothing.
        return self.healthy and self.load is not None and self.load.serving and not self.load.stalled

    def on_report(self, report: epb.LoadReport) -> None:
        self.load = sanitized(report)
        self.load_time = time.monotonic()
        self.dispatched_since_report = 0
        self.healthy = True
        self.set_adapters(report.lora_adapters)

    def set_adapters(self, adapters) -> None:
        """What the pod says it serves now (a report's `lora_adapters`, or a
        LoRAAdapterList answer): names outside the adapter name rule are
        dropped, and at most MAX_REPORTED_ADAPTERS are kept."""
        kept: dict[str, epb.LoRAAdapter] = {}
        for adapter in adapters:
            if len(kept) >= MAX_REPORTED_ADAPTERS:
                break
            if LORA_NAME_RE.fullmatch(adapter.name):
                kept[adapter.name] = adapter
        self.adapters = kept

    def eject(self) -> None:
        self.healthy = False

    def waiting(self) -> int:
        return (self.load.num_waiting if self.load else 0) + self.dispatched_since_report

    def pending_prefill_tokens(self) -> int:
        """Tokens the pod must prefill before a new request's own, as of its last report. This
        gateway's dispatches since are not added: most of a short prompt is prefilled before the
        next report, and a stale count would push a conversation off the pod holding it
        (dispatched_since_report, in the waiting term, covers a burst between reports)."""
        return self.load.num_pending_prefill_tokens if self.load else 0

    def free_slots(self, max_waiting: int, max_kv_usage: float) -> int:
        """How many more requests this pod can queue before it is saturated."""
        if not self.routable or self.load.kv_cache_usage >= max_kv_usage:
            return 0
        return max(0, max_waiting - self.waiting())

    async def close(self) -> None:
        await self.channel.close(grace=None)

    async def close_when_idle(self, max_wait_s: float) -> None:
        """Close the channel once this gateway's calls on it have ended, or
        after ``max_wait_s``: a pod leaving the pool (scaled down, so
        terminating and draining) finishes what it runs instead of having
        it cut here."""
        deadline = time.monotonic() + max_wait_s
        while self.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await self.close()
