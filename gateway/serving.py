"""The serving pipeline: authenticate -> validate and tokenize -> admit ->
route -> (prefill on a prefill pod) -> generate on an engine pod -> stream
choices back (gateway/response_stream.py).

The front ends call `Gateway.authenticate` before they read the body (401
before 400); `Gateway.open_stream` runs every other step that can refuse the
request and waits for the first engine output, so the front ends answer a
refusal with its proper status (400, 404, 429, 503) before any byte of a
stream is sent, an engine pod's refusal of the request included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from opentelemetry import trace

from gateway.admission import AdmissionController, Rejected, Ticket
from gateway.catalog import ModelCatalog
from gateway.config import GatewayConfig
from gateway.loop_lag import LoopLag
from gateway.errors import (
    GatewayError,
    bad_request,
    permission_denied,
    rate_limited,
    unauthenticated,
    unavailable,
)
from gateway.metrics import GatewayMetrics
from gateway.model import PromptError, ServedModel
from gateway.pods import Pod, PodPool
from gateway.priority import PriorityClass, PriorityClasses, PriorityClassError
from gateway.rejections import count_rejection
from gateway.request import GenerationRequest, SamplingOptions
from gateway.request_span import record_admitted, record_request, record_routed
from gateway.response_stream import ResponseStream
from gateway.router import Router, ScoredPod
from gateway.tenants import AdminRefused, AuthError, Tenant, TenantRegistry
from kv_store.block_hash import hash_request_tokens
from tessera.internal_channel import InternalClient
from tessera.roles import POD_ROLES
from tessera.tracing import tracer

_tracer = tracer("tessera.gateway")

# Pool changes reach admission at most this often (Gateway._on_pool_change).
CAPACITY_REFRESH_S = 0.02
# How often a request admitted as the last pod left looks for a pod again.
_NO_POD_POLL_S = 0.05


@dataclasses.dataclass
class Plan:
    """Where a request's engine calls go."""

    candidates: list[Pod]
    prefill_candidates: list[Pod]
    matched_tokens: int


class Gateway:
    def __init__(self, config: GatewayConfig, model: ServedModel, tenants: TenantRegistry,
                 classes: PriorityClasses, metrics: GatewayMetrics | None = None,
                 internal: InternalClient | None = None) -> None:
        self.config = config
        self.model = model
        self.tenants = tenants
        self.classes = classes
        self.metrics = metrics or GatewayMetrics()
        self.loop_lag = LoopLag()  # started by the server (gateway/main.py), with the loop
        self._refresh_pending = False
        self.pool = PodPool(config.router, config.admission, on_change=self._on_pool_change, client=internal,
                            loop_lag=self.loop_lag)
        self.admission = AdmissionController(
            max_queue_len=config.admission.max_queue_len, queue_timeout_s=config.admission.queue_timeout_s
        )
        self.router = Router(self.pool, config.router, config.admission, model.block_size, self.metrics)
        # The base model and its LoRA adapters: what a request's `model` may name.
        self.catalog = ModelCatalog(config.model.name, [lora.name for lora in config.model.loras], self.pool)
        for pclass in self.classes:
            # Read at each scrape, so a request counts from the moment it
            # queues: the operator lifts a pool from zero on this demand.
            self.metrics.queue_length.labels(pclass.name).set_function(
                lambda name=pclass.name: self.admission.queue_len_by_class().get(name, 0))
        self.metrics.pushed_prefix_blocks.set_function(self.pool.prefix_index.num_keys)
        self._refresh_capacity()  # no pod has been seen yet: with queue_without_pods, requests queue

    def _on_pool_change(self) -> None:
        """Every load report and ejection lands here: the admission capacity
        is refreshed at most once per CAPACITY_REFRESH_S, since refreshing
        walks every pod (per report, that alone took 40% of a core at 128 pods)."""
        if self._refresh_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # built outside the loop (start-up, tests): at once
            self._refresh_capacity()
            return
        self._refresh_pending = True
        loop.call_later(CAPACITY_REFRESH_S, self._refresh_capacity)

    def _refresh_capacity(self) -> None:
        self._refresh_pending = False
        if self.config.admission.queue_without_pods and not self.pool.routable():
            # Nothing to run on: every request queues until a pod is routable.
            self.admission.set_capacity(0)
        elif any(p.load is not None for p in self.pool.pods.values()):
            # Until a pod has reported, capacity is unknown: do not hold requests back.
            self.admission.set_capacity(self.pool.free_slots())
        for role in POD_ROLES:
            self.metrics.pods_routable.labels(role).set(len(self.pool.routable(role)))

    @property
    def ready(self) -> bool:
        """Takes requests now: a pod is routable, or requests queue until one is."""
        return bool(self.pool.routable()) or self.config.admission.queue_without_pods

    async def close(self) -> None:
        await self.pool.close()

    # -- the pipeline ----------------------------------------------------
    async def open_stream(self, req: GenerationRequest, tenant: Tenant, endpoint: str) -> ResponseStream:
        """The request admitted, routed and answering (its first output
        read); raises GatewayError for every refusal. `tenant` comes from
        `authenticate`, which the front ends call before they read the body."""
        arrival = time.monotonic()
        record_request(trace.get_current_span(), req)  # the front end's SERVER span
        labels = (tenant.name, "")  # the class once resolved: never the client's unchecked name
        try:
            lora_name, pclass, prompt_ids, max_tokens = self._validate(req, tenant)
            labels = (tenant.name, pclass.name)
            if not self.pool.routable() and not self.config.admission.queue_without_pods:
                raise unavailable("no engine pod is serving; retry shortly", "no_engine_pod")
            ticket = await self._admit(tenant, pclass, len(prompt_ids), req.options.n * max_tokens)
        except GatewayError as e:
            count_rejection(self.metrics, e, labels, endpoint)
            self.metrics.model_requests.labels(self.catalog.metric_label(req.model), endpoint, "rejected").inc()
            raise e from None
        stream = ResponseStream(self, req, tenant, pclass, prompt_ids, max_tokens, ticket, arrival, endpoint,
                                lora_name)
        try:
            await stream.start()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    def authenticate(self, authorization: str | None, endpoint: str = "") -> Tenant:
        """`endpoint`: the refused request's label in the metrics."""
        try:
            return self.tenants.authenticate(authorization)
        except AuthError as e:
            error = unauthenticated(str(e))
            count_rejection(self.metrics, error, ("", ""), endpoint)
            raise error from None

    def check_admin(self, tenant: Tenant, endpoint: str = "") -> None:
        """403 unless `tenant` may call the admin endpoints (gateway/tenants.py)."""
        try:
            self.tenants.check_admin(tenant)
        except AdminRefused as e:
            error = permission_denied(str(e))
            count_rejection(self.metrics, error, (tenant.name, ""), endpoint)
            raise error from None

    def _validate(self, req: GenerationRequest, tenant: Tenant) -> tuple[str, PriorityClass, list[int], int]:
        """The request's LoRA adapter ("" for the base model), class, prompt ids and max_tokens."""
        lora_name = self.catalog.resolve(req.model, tenant)
        try:
            pclass = self.classes.resolve(tenant, req.priority_class)
        except PriorityClassError as e:
            raise bad_request(str(e), "invalid_priority_class", "priority_class") from None
        try:
            req.options.validate()
        except ValueError as e:
            raise bad_request(str(e), "invalid_value", str(e).split(":")[0]) from None
        try:
            prompt_ids = self._tokenize(req)
            self.model.check_token_ids(prompt_ids)
            max_tokens = self.model.check_length(len(prompt_ids), req.options.max_tokens)
        except PromptError as e:
            raise bad_request(str(e), e.code, e.param) from None
        self._check_against_model(req.options, max_tokens)
        return lora_name, pclass, prompt_ids, max_tokens

    def _check_against_model(self, options: SamplingOptions, max_tokens: int) -> None:
        """The limits only the served model knows, checked here so the
        engine never refuses what the gateway admitted."""
        vocab = self.model.vocab_size
        bad = [t for t in options.stop_token_ids if t >= vocab]
        if bad:
            raise bad_request(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                              "invalid_token_id", "stop_token_ids")
        if options.min_tokens > max_tokens:
            raise bad_request(f"min_tokens: {options.min_tokens} is more than the {max_tokens} output tokens "
                              "this request may generate (max_tokens, or what the context leaves)",
                              "invalid_value", "min_tokens")

    def _tokenize(self, req: GenerationRequest) -> list[int]:
        if req.messages is not None:
            return self.model.encode_chat(req.messages, req.add_generation_prompt, req.tools)
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        return self.model.encode(req.prompt or "")

    async def _admit(self, tenant: Tenant, pclass: PriorityClass, num_prompt_tokens: int,
                     max_output_tokens: int) -> Ticket:
        request_span = trace.get_current_span()
        with _tracer.start_as_current_span("gateway.admission") as span:
            span.set_attribute("tessera.tenant", tenant.name)
            span.set_attribute("tessera.priority_class", pclass.name)
            try:
                ticket = await self.admission.admit(tenant, pclass, num_prompt_tokens, max_output_tokens)
                record_admitted(request_span, ticket.queue_wait_s, pclass.name)
                return ticket
            except Rejected as e:  # counted by open_stream: the error's code is the reason
                span.set_attribute("tessera.rejected", e.reason)
                if e.reason == "queue_timeout":
                    raise unavailable(e.message, e.reason, e.retry_after) from None
                raise rate_limited(e.message, e.reason, e.retry_after) from None

    async def plan(self, prompt_ids: list[int], cache_salt: str, request_id: str,
                   deadline: float | None = None, adapter: str = "") -> Plan:
        """Rank pods for the request; decide on P/D disaggregation. With
        admission.queue_without_pods, a request admitted just before the
        last pod left waits for one (until `deadline`, a time.monotonic();
        default queue_timeout_s from now) instead of a 503. `adapter`: the
        request's LoRA adapter ("" for the base model)."""
        request_span = trace.get_current_span()
        with _tracer.start_as_current_span("gateway.route") as span:
            hashes = self._block_hashes(prompt_ids, cache_salt, adapter)
            key = hashes[0] if hashes else request_id.encode()
            keys = self.router.block_keys(hashes)
            plan = await self._ranked_plan(hashes, keys, len(prompt_ids), key, adapter)
            if not plan.candidates and self.config.admission.queue_without_pods:
                if deadline is None:
                    deadline = time.monotonic() + self.config.admission.queue_timeout_s
                while not plan.candidates and time.monotonic() < deadline:
                    await asyncio.sleep(_NO_POD_POLL_S)
                    plan = await self._ranked_plan(hashes, keys, len(prompt_ids), key, adapter)
            if not plan.candidates:
                raise unavailable("no engine pod is serving; retry shortly", "no_engine_pod")
            span.set_attribute("tessera.pod", plan.candidates[0].address)
            span.set_attribute("tessera.prefix_hit_tokens", plan.matched_tokens)
            span.set_attribute("tessera.disaggregated", bool(plan.prefill_candidates))
            record_routed(request_span, plan.candidates[0].address, plan.matched_tokens, bool(plan.prefill_candidates))
            self.metrics.prefix_hit_tokens.labels(plan.candidates[0].address).inc(plan.matched_tokens)
            self.router.note_routed(plan.candidates[:1] + plan.prefill_candidates[:1], keys)
            return plan

    def _block_hashes(self, prompt_ids: list[int], cache_salt: str, adapter: str) -> list[bytes]:
        """The prompt's chained block hashes as the pods compute them: with the
        tenant's salt and, on an adapter, its fingerprint from the pods'
        reports. An adapter no pod reports yet gets a stand-in that matches
        no cached block (nothing to match: no pod has computed under it)."""
        fingerprint = None
        if adapter:
            fingerprint = self.catalog.fingerprint(adapter) or f"unreported:{adapter}"
        return hash_request_tokens(prompt_ids, self.model.block_size, cache_salt, adapter=fingerprint)

    async def _ranked_plan(self, hashes: list[bytes], keys: list[int], num_tokens: int, key: bytes,
                           adapter: str) -> Plan:
        if self.pool.disaggregated:
            return await self._plan_disaggregated(hashes, keys, num_tokens, key, adapter)
        ranked = await self.router.rank("mixed", hashes, num_tokens, key, keys, adapter)
        if not ranked:  # only P/D pods, one pool down: decode pods compute prompts themselves
            ranked = await self.router.rank("decode", hashes, num_tokens, key, keys, adapter)
            if ranked and self._wants_prefill_pod(ranked[0], num_tokens):
                self.metrics.prefills_unplaced.inc()  # a prefill pool at zero: its only demand signal
        return self._plan_from(ranked, [])

    def _wants_prefill_pod(self, decode: ScoredPod, num_tokens: int) -> bool:
        """Disaggregation's test: the prompt's part not cached on its decode pod is worth a prefill pod."""
        uncached = num_tokens - decode.matched_blocks * self.model.block_size
        return uncached >= self.config.disaggregation.min_uncached_tokens

    async def _plan_disaggregated(self, hashes: list[bytes], keys: list[int], num_tokens: int,
                                  key: bytes, adapter: str) -> Plan:
        decode = await self.router.rank("decode", hashes, num_tokens, key, keys, adapter)
        if not decode or not self._wants_prefill_pod(decode[0], num_tokens):
            return self._plan_from(decode, [])
        prefill_ranked = await self.router.rank("prefill", hashes, num_tokens, key, keys, adapter)
        return self._plan_from(decode, [s.pod for s in prefill_ranked])

    def _plan_from(self, ranked: list[ScoredPod], prefill_pods: list[Pod]) -> Plan:
        matched = ranked[0].matched_blocks * self.model.block_size if ranked else 0
        return Plan([s.pod for s in ranked], prefill_pods, matched)
