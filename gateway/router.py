"""KV-aware routing: score every routable pod, best first.

    score(pod) =   w_prefix  * cached_fraction
                 - w_waiting * (waiting + dispatched_since_report) / max_waiting_per_pod
                 - w_running * running / running_norm
                 - w_kv      * kv_cache_usage
                 + tie_break

`cached_fraction` is the share of the prompt's tokens in the pod's prefix
cache: the leading blocks of the prompt's chained hashes (computed with the
tenant's salt by `kv_store.block_hash`) that the pod itself reports holding.
Asking the pods instead of remembering where requests went lets several
gateway replicas run active-active without shared state. `tie_break` is a
rendezvous hash of the prompt's first block and the pod address, below
1e-6: prompts sharing a prefix that no pod holds yet still agree on a pod.
docs/gateway.md explains the weights.

With `router.policy: round_robin` the router skips all of this (no prefix
queries) and rotates through the routable pods: the baseline the routing
benchmark compares the scorer against.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

import grpc

from gateway.config import AdmissionConfig, RouterConfig
from gateway.pods import Pod, PodPool
from tessera.v1 import engine_pb2 as epb

_TIE_BREAK_SCALE = 1e-6


@dataclass(frozen=True)
class PodLoad:
    waiting: int
    running: int
    kv_usage: float


@dataclass
class ScoredPod:
    pod: Pod
    score: float
    matched_blocks: int


def score_pod(cached_fraction: float, load: PodLoad, config: RouterConfig, max_waiting: int) -> float:
    w = config.weights
    return (
        w.prefix * cached_fraction
        - w.waiting * load.waiting / max_waiting
        - w.running * load.running / config.running_norm
        - w.kv_usage * load.kv_usage
    )


def tie_break(key: bytes, address: str) -> float:
    digest = hashlib.sha256(key + address.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * _TIE_BREAK_SCALE


class Router:
    def __init__(self, pool: PodPool, config: RouterConfig, admission: AdmissionConfig, block_size: int) -> None:
        self.pool = pool
        self.config = config
        self.max_waiting = admission.max_waiting_per_pod
        self.block_size = block_size
        # Round robin: the next starting position, per role.
        self._turn: dict[str, int] = {}

    async def rank(self, role: str, block_hashes: list[bytes], num_prompt_tokens: int,
                   key: bytes) -> list[ScoredPod]:
        """Routable pods of `role`, best first (empty if none)."""
        pods = self.pool.routable(role)
        if not pods:
            return []
        if self.config.policy == "round_robin":
            return self._rotate(role, pods)
        if block_hashes and len(pods) > 1:
            matched = await asyncio.gather(*(self._matched_blocks(p, block_hashes) for p in pods))
        elif block_hashes:
            matched = [await self._matched_blocks(pods[0], block_hashes)]
        else:
            matched = [0] * len(pods)
        scored = []
        for pod, blocks in zip(pods, matched):
            fraction = min(1.0, blocks * self.block_size / max(1, num_prompt_tokens))
            load = PodLoad(pod.waiting(), pod.load.num_running, pod.load.kv_cache_usage)
            score = score_pod(fraction, load, self.config, self.max_waiting) + tie_break(key, pod.address)
            scored.append(ScoredPod(pod, score, blocks))
        scored.sort(key=lambda s: s.score, reverse=True)
        return scored

    def _rotate(self, role: str, pods: list[Pod]) -> list[ScoredPod]:
        """The pods starting at this role's turn (the rest stay as retry
        fallbacks), scored by position so the order reads best first."""
        turn = self._turn.get(role, 0) % len(pods)
        self._turn[role] = turn + 1
        rotated = pods[turn:] + pods[:turn]
        return [ScoredPod(pod, -float(i), 0) for i, pod in enumerate(rotated)]

    async def _matched_blocks(self, pod: Pod, block_hashes: list[bytes]) -> int:
        """Leading blocks the pod holds, as it reports them; 0 if it does not
        answer in time (the load terms still use its pushed report)."""
        timeout = self.config.prefix_query_timeout_ms / 1000
        try:
            report = await pod.stub.GetLoad(epb.LoadRequest(block_hashes=block_hashes), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.eject(pod, "prefix query: UNAVAILABLE")
            return 0
        return report.matched_prefix_blocks
