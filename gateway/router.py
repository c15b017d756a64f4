"""KV-aware routing: rank the routable pods of a role, best first.

Three policies (`router.policy`); `score` and `bounded` rank with one formula:

    score(pod) =   w_prefix  * cached_fraction
                 - w_prefill_backlog * pending_prefill_tokens / prompt_tokens
                 - w_waiting * (waiting + dispatched_since_report) / max_waiting_per_pod
                 - w_running * running / running_norm
                 - w_kv      * kv_cache_usage
                 + tie_break

The first two terms are in one unit, tokens as a share of the prompt: what
the pod's cache saves this prompt against what the pod must prefill before
it (the backlog of its last load report, or of its answer to this
request's prefix query: a report up to an interval old still counts a
prompt prefilled since). At the default weights (1 and
0.5) a pod holding the prefix keeps winning while its backlog is under
twice the tokens its cache saves: beyond, the request's first token comes
much sooner on a cold pod, worth the prefill it costs there. Without the
backlog term a pod caching every tenant's system prompt (the first pod of
a fleet scaled up from one) took every request however long its queue grew.

`cached_fraction` is the share of the prompt's tokens in the pod's prefix
cache: the leading blocks of the prompt's chained hashes (computed with the
tenant's salt by `kv_store.block_hash`) that the pod itself reports holding
(one Engine.GetLoad per pod asked: `Router._matched_blocks`). Asking the pods
instead of remembering where requests went lets several gateway replicas run
active-active without shared state. `tie_break` is a rendezvous hash of the
prompt's first block and the pod address, below 1e-6: prompts sharing a
prefix that no pod holds yet still agree on a pod. docs/gateway.md explains
the weights.

`score` (the default) asks every routable pod: one RPC per pod per request.

Where `cached_fraction` comes from is `router.prefix_match`:

- `query` (the default): an Engine.GetLoad to each scored pod, exact as of
  that instant, one RPC per scored pod per request.
- `pushed`: each pod pushes its prefix cache's contents as 64-bit block keys
  on its load stream, the whole set and then the changes
  (gateway/pods/prefix_index.py); the match is a few set lookups here, no
  RPC, up to one `load_interval_ms` stale. `score` then knows every pod's
  cache at the cost of a lookup per pod (the fleet benchmark's oracle).

`round_robin` skips all of this (no prefix queries) and rotates through the
routable pods: the baseline the routing benchmark compares the scorer against.

`bounded` asks at most `affinity_candidates + load_candidates` pods, whatever
the fleet size, chosen without any state a replica would have to share:

- Affinity candidates: where the prompt's prefix is likely cached. The hash
  at depth d of a chained list names the whole prefix up to block d, so its
  owner on a consistent-hash ring of the routable addresses
  (gateway/hash_ring.py) is a pure function of that prefix and the set of
  pods: every replica computes the same owner, a pod joining or leaving
  moves only the prefixes it wins or owned, and finding it is a binary
  search, not a hash per pod. The depths looked at form a ladder, 1, 2, 4, 8, ... up to
  the prompt's length, walked deepest first; each depth adds its owner
  unless already chosen, until `affinity_candidates` pods are chosen.
  Powers of two, and not the prompt's last full block: a prompt that
  extends this one (the next turn of a conversation) has every depth of
  this ladder on its own, so it looks where this prompt went. The last full
  block of a turn is, but for luck, on no ladder of the next turn: a
  conversation placed by it would be lost at its next turn.
- Placement: every affinity candidate's score gets `affinity_bonus`, so
  among candidates holding the same prefix (none yet, for a new
  conversation) an owner wins unless it carries that much more load: a load
  report a request stale must not send a new prefix to a load candidate,
  which the prompt's next request would not ask. Among the owners, the one
  of the deepest ladder depth wins (`_affinity_tie`), then the next depth
  up. Deepest, because the first block is a tenant's shared system prompt: its owner would take all of the tenant's
  conversations, while deep prefixes are one conversation's own and spread
  over the fleet; and because the next turn's ladder has that depth too.
- Multi-turn: a conversation placed at the owner of depth D stays a
  candidate while its prompt's deepest ladder depth is below
  D * 2**affinity_candidates (one of the first `affinity_candidates` steps
  down the ladder; repeated owners reach further). A holder of the prefix
  outscores the others, so the conversation stays put; once its prompt
  outgrows that, its pod drops out, the tie places it at the owner of the
  new deepest depth, and it stays there for the next 2**affinity_candidates-
  fold growth. The prompts prefilled again at these moves grow
  geometrically, so over a conversation they add up to a small multiple of
  its final prompt, where landing anywhere costs a full prefill per turn.
- Load candidates: the `load_candidates` least loaded other pods by their
  pushed reports (the prefill backlog, then waiting including this
  gateway's dispatched_since_report, then running, then KV usage; equal loads from a position the prompt's
  key picks, so prompts spread over equally idle pods): when the
  affinity candidates are busy, an idle pod can still win on score, as under
  `score`. Reports reach all replicas alike, but each replica counts only its
  own dispatches, so replicas may differ here; they agree on where a prefix
  lives, the part that needs agreement. A prompt shorter than a block has
  load candidates only, and nothing to ask: no RPC at all.
- Holder candidates (`prefix_match: pushed` only): the `holder_candidates`
  least loaded pods holding the longest run of the prompt's leading blocks
  that any pod holds, read from the pushed index (a dictionary lookup per
  block and a bitmask of holders, not a pass over the fleet). A
  conversation that its owners were too busy to take, or a tenant's system
  prompt cached on pods the ring does not name, is still found.
- The candidates come first, best first; a candidate ejected by its query
  (UNAVAILABLE) is left out. Then up to BOUNDED_FALLBACKS more of the least
  loaded pods, by their pushed load alone (no RPC): the fallbacks of the
  retry and failover code, as many as one request can try.
- Cost: one pass over the pushed loads (a tuple per pod, a partial sort),
  the ring lookups, and the k queries (none when pushed); the ring is
  rebuilt only when the set of routable pods changes.

LoRA adapters (a request whose `model` is an adapter, `adapter` below):

- Only pods whose reports list the adapter are ranked, if any does; when
  none does (reports without it, an older pod) every pod is, and a pod's
  NOT_FOUND is the client's 404 (gateway/engine_call.py).
- The score gets `w_lora_resident * resident`, 1 where the pod holds the
  adapter's weights in host memory (its report's `resident`): its
  requests stay on those pods until they are busier by that much, then go
  to another pod serving it, which loads it: a popular adapter spreads
  over more pods, an occasional one stays where it is.
- The prompt's block hashes carry the adapter's fingerprint (the caller
  hashes with `adapter=`, gateway/serving.py), so prefix matches, asked or
  pushed, are the adapter's own.
- bounded: the `load_candidates` least loaded pods holding the adapter
  resident join the candidates, so the pods holding it are asked wherever
  the ring points.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
from dataclasses import dataclass

import grpc

from gateway.catalog import resident, serves
from gateway.config import AdmissionConfig, RouterConfig
from gateway.hash_ring import HashRing
from gateway.metrics import GatewayMetrics
from gateway.pods import Pod, PodPool
from gateway.pods.pod import sanitized
from kv_store.block_hash import block_key
from tessera.v1 import engine_pb2 as epb

_TIE_BREAK_SCALE = 1e-6
# bounded: pods ranked after the candidates, by pushed load alone, as retry
# fallbacks: as many as a request can try (gateway/engine_call.py).
BOUNDED_FALLBACKS = 8

# A failed prefix query's outcome label on tessera_gateway_prefix_queries.
_QUERY_OUTCOMES = {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout"}


@dataclass(frozen=True)
class PodLoad:
    waiting: int
    running: int
    kv_usage: float
    pending_prefill_tokens: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """A pod's match of a prompt's leading blocks."""
    blocks: int
    # The pod's answer to the prefix query (its load as of now); None when
    # the match came from its pushed cache or the query failed.
    answer: epb.LoadReport | None = None


NO_MATCH = PrefixMatch(0)


@dataclass
class ScoredPod:
    pod: Pod
    score: float
    matched_blocks: int


def score_pod(cached_fraction: float, load: PodLoad, config: RouterConfig, max_waiting: int,
              num_prompt_tokens: int, adapter_resident: bool = False) -> float:
    """`adapter_resident`: the request runs on a LoRA adapter whose weights the pod holds."""
    w = config.weights
    return (
        w.prefix * cached_fraction
        - w.prefill_backlog * load.pending_prefill_tokens / max(1, num_prompt_tokens)
        - w.waiting * load.waiting / max_waiting
        - w.running * load.running / config.running_norm
        - w.kv_usage * load.kv_usage
        + w.lora_resident * adapter_resident
    )


def adapter_pods(pods: list[Pod], adapter: str) -> list[Pod]:
    """The pods a request on `adapter` may go to: those serving it, if any
    does (module docstring); all of them for the base model ("")."""
    if not adapter:
        return pods
    serving = [p for p in pods if serves(p, adapter)]
    return serving or pods


def tie_break(key: bytes, address: str) -> float:
    """The score policy's tie-break: a rendezvous hash of the key and the pod."""
    digest = hashlib.sha256(key + address.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * _TIE_BREAK_SCALE


def _load_tie(position: int, count: int) -> float:
    """The tie-break of the load candidate (or fallback) at `position` in
    load order: less loaded first, below every affinity tie-break."""
    return (count - position) / (count + 1) * _TIE_BREAK_SCALE


def _affinity_tie(position: int, count: int) -> float:
    """The tie-break of the affinity candidate at `position` (0: the deepest
    depth's owner) of `count`: above every rendezvous tie-break, so on a tie
    it beats the load candidates, and deeper beats shallower."""
    return (1 + count - position) * _TIE_BREAK_SCALE


def ladder_depths(num_blocks: int) -> list[int]:
    """The depths 1, 2, 4, 8, ... up to `num_blocks`, deepest first."""
    if num_blocks < 1:
        return []
    return [1 << i for i in range(num_blocks.bit_length() - 1, -1, -1)]


def affinity_candidates(block_hashes: list[bytes], pods: list[Pod], ring: HashRing, limit: int) -> list[Pod]:
    """The ring owners of the prompt's ladder depths, deepest first, each
    once, at most `limit`; `ring` was built from `pods`' addresses, in order."""
    chosen: dict[str, Pod] = {}
    for depth in ladder_depths(len(block_hashes)):
        if len(chosen) >= limit:
            break
        pod = pods[ring.owner_index(block_hashes[depth - 1])]
        chosen.setdefault(pod.address, pod)
    return list(chosen.values())


def least_loaded(pods: list[Pod], count: int, key: bytes) -> list[Pod]:
    """The `count` pods with the least pushed load, least first. Equal loads
    are ordered by the pod's address hash mixed with the request's key: the
    same order whatever the pool's order (replicas agree), and prompts
    spread over equally idle pods, without a hash per pod per request."""
    if count <= 0 or not pods:
        return []
    spread = int.from_bytes(key[:8], "big")
    loads = [(p.pending_prefill_tokens(), p.waiting(), p.load.num_running, p.load.kv_cache_usage,
              p.address_hash ^ spread, i) for i, p in enumerate(pods)]
    return [pods[entry[-1]] for entry in heapq.nsmallest(count, loads)]


def _best_first(scored: list[ScoredPod]) -> list[ScoredPod]:
    return sorted(scored, key=lambda s: s.score, reverse=True)


class Router:
    def __init__(self, pool: PodPool, config: RouterConfig, admission: AdmissionConfig, block_size: int,
                 metrics: GatewayMetrics | None = None) -> None:
        self.pool = pool
        self.config = config
        self.max_waiting = admission.max_waiting_per_pod
        self.block_size = block_size
        self._prefix_queries = (metrics or GatewayMetrics()).prefix_query_outcomes
        # Round robin: the next starting position, per role.
        self._turn: dict[str, int] = {}
        # Bounded: the hash ring of the last pod set it routed over.
        self._ring: HashRing | None = None
        # Prefix matches read from the pods' pushed caches (pool.prefix_index), not asked.
        self._pushed = config.prefix_match == "pushed"

    def block_keys(self, block_hashes: list[bytes]) -> list[int]:
        """The prompt's block keys under prefix_match pushed (else none): worked
        out once per request and passed to `rank` and `note_routed`."""
        return [block_key(h) for h in block_hashes] if self._pushed else []

    async def rank(self, role: str, block_hashes: list[bytes], num_prompt_tokens: int,
                   key: bytes, keys: list[int] | None = None, adapter: str = "") -> list[ScoredPod]:
        """Routable pods of `role`, best first (empty if none); `keys`:
        `block_keys(block_hashes)`, if the caller has them already;
        `adapter`: the request's LoRA adapter ("" for the base model), whose
        hashes `block_hashes` must be."""
        pods = adapter_pods(self.pool.routable(role), adapter)
        if not pods:
            return []
        if self.config.policy == "round_robin":
            return self._rotate(role, pods)
        if keys is None:
            keys = self.block_keys(block_hashes)
        if self.config.policy == "bounded":
            return await self._rank_bounded(role, pods, block_hashes, keys, num_prompt_tokens, key, adapter)
        matched = await self._match(pods, block_hashes, keys)
        return _best_first([self._scored(pod, match, num_prompt_tokens, tie_break(key, pod.address), adapter)
                            for pod, match in zip(pods, matched)])

    async def _rank_bounded(self, role: str, pods: list[Pod], block_hashes: list[bytes], keys: list[int],
                            num_prompt_tokens: int, key: bytes, adapter: str) -> list[ScoredPod]:
        """The bounded policy (module docstring): score the candidates only,
        then append up to BOUNDED_FALLBACKS others ranked by pushed load.
        Nothing here hashes or scores every pod: a request costs the same
        at 16 pods and at 256, but for one pass over the pushed loads."""
        affinity = affinity_candidates(block_hashes, pods, self._ring_of(pods), self.config.affinity_candidates)
        chosen = {p.address for p in affinity}
        holders = self._holders(role, keys, chosen, key)
        if adapter:  # only among the pods it may go to: one holding its blocks may have stopped serving it
            allowed = {p.address for p in pods}
            holders = [p for p in holders if p.address in allowed]
        chosen.update(p.address for p in holders)
        holders += self._adapter_holders(pods, adapter, chosen, key)
        chosen.update(p.address for p in holders)
        others = [p for p in pods if p.address not in chosen]
        by_load = least_loaded(others, self.config.load_candidates + BOUNDED_FALLBACKS, key)
        load, fallbacks = by_load[:self.config.load_candidates], by_load[self.config.load_candidates:]
        candidates = affinity + holders + load
        bonus = self.config.affinity_bonus
        candidate_ties = [bonus + _affinity_tie(i, len(affinity)) for i in range(len(affinity))]
        candidate_ties += [_load_tie(i, len(holders)) for i in range(len(holders))]
        candidate_ties += [_load_tie(i, len(load)) for i in range(len(load))]
        matched = await self._match(candidates, block_hashes, keys)
        ranked = [self._scored(pod, match, num_prompt_tokens, tie, adapter)
                  for pod, match, tie in zip(candidates, matched, candidate_ties) if pod.routable]
        rest = [self._scored(pod, NO_MATCH, num_prompt_tokens, _load_tie(i, len(fallbacks)), adapter)
                for i, pod in enumerate(fallbacks)]
        return _best_first(ranked) + _best_first(rest)

    def _adapter_holders(self, pods: list[Pod], adapter: str, chosen: set[str], key: bytes) -> list[Pod]:
        """bounded, a request on an adapter: the `load_candidates` least loaded
        pods holding it resident, other than those `chosen`."""
        if not adapter:
            return []
        holding = [p for p in pods if p.address not in chosen and resident(p, adapter)]
        return least_loaded(holding, self.config.load_candidates, key)

    def note_routed(self, pods: list[Pod], keys: list[int]) -> None:
        """prefix_match pushed: the request goes to these pods (its pod, and
        its prefill pod under P/D), so they count as holding its blocks
        (`keys`: block_keys) before their next push says so
        (gateway/pods/prefix_index.py)."""
        for pod in pods:
            self.pool.prefix_index.note_routed(pod.address, keys)

    def _holders(self, role: str, keys: list[int], chosen: set[str], key: bytes) -> list[Pod]:
        """bounded, pushed: the least loaded routable pods of `role` holding
        the prompt's longest cached prefix, other than those `chosen`."""
        if not keys or self.config.holder_candidates == 0:
            return []
        _, addresses = self.pool.prefix_index.deepest_holders(keys)
        holding = [pod for a in addresses if a not in chosen and (pod := self.pool.pods.get(a)) is not None
                   and pod.role == role and pod.routable]
        return least_loaded(holding, self.config.holder_candidates, key)

    def _ring_of(self, pods: list[Pod]) -> HashRing:
        """The ring of these pods' addresses, rebuilt only when they change."""
        addresses = tuple(p.address for p in pods)
        if self._ring is None or self._ring.addresses != addresses:
            self._ring = HashRing(addresses)
        return self._ring

    def _scored(self, pod: Pod, match: PrefixMatch, num_prompt_tokens: int, tie: float,
                adapter: str = "") -> ScoredPod:
        fraction = min(1.0, match.blocks * self.block_size / max(1, num_prompt_tokens))
        held = bool(adapter) and resident(pod, adapter)
        score = score_pod(fraction, self._load(pod, match.answer), self.config, self.max_waiting, num_prompt_tokens,
                          held)
        return ScoredPod(pod, score + tie, match.blocks)

    @staticmethod
    def _load(pod: Pod, answer: epb.LoadReport | None) -> PodLoad:
        """The pod's load for its score: the pushed report's, or where a
        prefix query was answered just now, that answer's backlog, running
        and KV usage (a pushed report up to an interval old still counts a
        prompt prefilled since). Waiting stays the pushed count plus this
        gateway's dispatches since: those may not have reached the pod yet."""
        report = pod.load if answer is None else answer
        return PodLoad(pod.waiting(), report.num_running, report.kv_cache_usage, report.num_pending_prefill_tokens)

    def _rotate(self, role: str, pods: list[Pod]) -> list[ScoredPod]:
        """The pods starting at this role's turn (the rest stay as retry
        fallbacks), scored by position so the order reads best first."""
        turn = self._turn.get(role, 0) % len(pods)
        self._turn[role] = turn + 1
        rotated = pods[turn:] + pods[:turn]
        return [ScoredPod(pod, -float(i), 0) for i, pod in enumerate(rotated)]

    async def _match(self, pods: list[Pod], block_hashes: list[bytes], keys: list[int]) -> list[PrefixMatch]:
        """Each pod's matched leading blocks: from what it pushed (no RPC)
        under prefix_match "pushed", else asked concurrently; no RPC for a
        prompt shorter than a block."""
        if not block_hashes:
            return [NO_MATCH] * len(pods)
        if self._pushed:
            index = self.pool.prefix_index
            return [PrefixMatch(index.matched_blocks(p.address, keys)) for p in pods]
        if len(pods) == 1:
            return [await self._matched_blocks(pods[0], block_hashes)]
        return list(await asyncio.gather(*(self._matched_blocks(p, block_hashes) for p in pods)))

    async def _matched_blocks(self, pod: Pod, block_hashes: list[bytes]) -> PrefixMatch:
        """Leading blocks the pod holds, as it reports them, with its answer;
        none if it does not answer in time (the load terms then use its
        pushed report)."""
        timeout = self.config.prefix_query_timeout_ms / 1000
        try:
            report = await pod.stub.GetLoad(epb.LoadRequest(block_hashes=block_hashes), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            self._prefix_queries[_QUERY_OUTCOMES.get(e.code(), "error")].inc()
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.eject(pod, "prefix query: UNAVAILABLE")
            return NO_MATCH
        self._prefix_queries["ok"].inc()
        report = sanitized(report)
        return PrefixMatch(report.matched_prefix_blocks, report)
