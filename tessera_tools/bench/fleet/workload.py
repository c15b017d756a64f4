"""The fleet benchmark's requests: token-id prompts, seeded, laid on a trace.

shared-prefix: T tenants, each with a system prompt of its own (hundreds of
tokens) and many multi-turn conversations. Turn k's prompt is the system
prompt, then every earlier turn's user message and ASSISTANT OUTPUT, then a
new user message. The outputs are what a simulated pod emits for that
prompt (engine_pod.sim.tokens.simulated_output), so turn k+1 really extends
what the pod that served turn k holds in its prefix cache. Each tenant
sends with its own API key, so the gateway salts its block hashes apart
from every other tenant's, as in production.

At each arrival of the trace, a conversation that is ready (its previous
turn arrived at least `think_s` earlier) takes its next turn with
probability 1 - new_conversation_share; otherwise a new conversation opens
for a tenant drawn by a Zipf law of exponent `tenant_skew` (0: uniform).
A conversation ends after its drawn number of turns, or when its next
prompt would not fit the context.

no-reuse: the same arrivals, tenants and prompt and output lengths, each
prompt fresh random ids: nothing for a prefix cache to find.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from engine_pod.sim.tokens import simulated_output

# Ids below this are left out of prompts (BOS, EOS and the tokenizer's other specials sit there).
FIRST_PROMPT_ID = 16


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of the shared-prefix workload (no-reuse copies its lengths)."""

    tenants: int
    """Tenants, each with its own system prompt and API key."""
    vocab_size: int
    """The checkpoint's vocabulary: prompt ids and simulated outputs lie below it."""
    eos_token_ids: frozenset[int]
    """Never in a prompt; the simulated outputs skip them too."""
    max_model_len: int
    """A conversation ends before its prompt plus output would exceed this."""
    system_prompt_len: tuple[int, int] = (300, 700)
    """Tokens of each tenant's system prompt: uniform in [min, max]."""
    user_len: tuple[int, int] = (20, 120)
    """Tokens of each user message."""
    output_len: tuple[int, int] = (16, 64)
    """max_tokens of each turn (simulated pods never stop early)."""
    max_turns: int = 6
    """A conversation's turns: uniform in [1, max_turns]."""
    new_conversation_share: float = 0.3
    """Chance that an arrival opens a conversation while one is ready to continue."""
    think_s: float = 5.0
    """At least this long between a turn's arrival and the next turn's."""
    tenant_skew: float = 0.5
    """Zipf exponent of the tenants' traffic (0: every tenant alike)."""


@dataclass(frozen=True)
class FleetRequest:
    """One request of the workload, in arrival order."""

    arrival_s: float
    """Offset from the start of the run."""
    tenant: int
    """Index of the tenant (its API key sends the request)."""
    prompt_token_ids: list[int] = field(repr=False)
    output_len: int
    conversation: int
    """Conversations are numbered in the order they open; -1: no conversation (no-reuse)."""
    turn: int
    """0 for a conversation's first request."""
    after: int | None = None
    """Index of the conversation's previous turn: sent only once that one has ended (a user reads the reply
    before typing the next message)."""


def _random_ids(rng: random.Random, length: int, vocab_size: int, eos: Collection[int]) -> list[int]:
    ids: list[int] = []
    population = range(FIRST_PROMPT_ID, vocab_size)
    while len(ids) < length:
        ids += [t for t in rng.choices(population, k=length - len(ids)) if t not in eos]
    return ids


def system_prompts(spec: WorkloadSpec, seed: int) -> list[list[int]]:
    """One per tenant, each from its own seeded stream (a tenant's prompt
    does not change with the number of tenants)."""
    prompts = []
    for tenant in range(spec.tenants):
        rng = random.Random(f"fleet-system-{seed}-{tenant}")
        prompts.append(_random_ids(rng, rng.randint(*spec.system_prompt_len), spec.vocab_size, spec.eos_token_ids))
    return prompts


@dataclass
class _Conversation:
    number: int
    tenant: int
    turns_left: int
    history: list[int]
    """The system prompt, then every turn's user message and output so far."""
    turns_done: int = 0
    last_request: int | None = None


class _Builder:
    """The state of shared_prefix_requests while it walks the trace."""

    def __init__(self, spec: WorkloadSpec, seed: int) -> None:
        self.spec = spec
        self.rng = random.Random(f"fleet-workload-{seed}")
        self.systems = system_prompts(spec, seed)
        weights = [1.0 / (rank + 1) ** spec.tenant_skew for rank in range(spec.tenants)]
        # Which tenant is popular is itself seeded, not always tenant 0.
        self.tenant_weights = self.rng.sample(weights, len(weights))
        self.waiting: list[tuple[float, int, _Conversation]] = []  # (ready at, number, conversation): a heap
        self.ready: list[_Conversation] = []
        self.opened = 0

    def _open(self) -> _Conversation:
        tenant = self.rng.choices(range(self.spec.tenants), self.tenant_weights)[0]
        conversation = _Conversation(self.opened, tenant, self.rng.randint(1, self.spec.max_turns),
                                     list(self.systems[tenant]))
        self.opened += 1
        return conversation

    def _pick(self, now: float) -> _Conversation:
        while self.waiting and self.waiting[0][0] <= now:
            self.ready.append(heapq.heappop(self.waiting)[2])
        if self.ready and self.rng.random() >= self.spec.new_conversation_share:
            i = self.rng.randrange(len(self.ready))
            self.ready[i], self.ready[-1] = self.ready[-1], self.ready[i]
            return self.ready.pop()
        return self._open()

    def request(self, index: int, now: float) -> FleetRequest:
        spec = self.spec
        while True:
            conversation = self._pick(now)
            user = _random_ids(self.rng, self.rng.randint(*spec.user_len), spec.vocab_size, spec.eos_token_ids)
            output_len = self.rng.randint(*spec.output_len)
            prompt = conversation.history + user
            if len(prompt) + output_len <= spec.max_model_len:
                break
            if conversation.turns_done == 0:
                raise ValueError(f"a first turn of {len(prompt)} + {output_len} tokens exceeds max_model_len "
                                 f"{spec.max_model_len}: shorten the system prompts or user messages")
            # Too long to go on: this conversation ends, and the arrival goes to another.
        request = FleetRequest(now, conversation.tenant, prompt, output_len, conversation.number,
                               conversation.turns_done, conversation.last_request)
        conversation.history = prompt + simulated_output(prompt, output_len, spec.vocab_size, spec.eos_token_ids)
        conversation.last_request = index
        conversation.turns_done += 1
        conversation.turns_left -= 1
        if conversation.turns_left > 0:
            heapq.heappush(self.waiting, (now + spec.think_s, conversation.number, conversation))
        return request


def shared_prefix_requests(spec: WorkloadSpec, offsets: list[float], seed: int) -> list[FleetRequest]:
    """One request per arrival of the trace (module docstring)."""
    builder = _Builder(spec, seed)
    return [builder.request(i, t) for i, t in enumerate(offsets)]


def no_reuse_requests(shared: list[FleetRequest], spec: WorkloadSpec, seed: int) -> list[FleetRequest]:
    """The shared-prefix requests with every prompt replaced by fresh random
    ids of its length: same arrivals, tenants and lengths, no shared prefix,
    no conversations to wait for."""
    rng = random.Random(f"fleet-no-reuse-{seed}")
    return [replace(r, prompt_token_ids=_random_ids(rng, len(r.prompt_token_ids), spec.vocab_size,
                                                    spec.eos_token_ids), conversation=-1, turn=0, after=None)
            for r in shared]


WORKLOADS = ("shared-prefix", "no-reuse")


def build_requests(name: str, spec: WorkloadSpec, offsets: list[float], seed: int) -> list[FleetRequest]:
    shared = shared_prefix_requests(spec, offsets, seed)
    if name == "shared-prefix":
        return shared
    if name == "no-reuse":
        return no_reuse_requests(shared, spec, seed)
    raise ValueError(f"workload {name!r}: expected one of {', '.join(WORKLOADS)}")
