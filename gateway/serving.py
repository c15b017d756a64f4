"""The serving pipeline: authenticate -> validate and tokenize -> admit ->
route -> (prefill on a prefill pod) -> generate on an engine pod -> stream
choices back.

The front ends call `Gateway.authenticate` before they read the body (401
before 400); `Gateway.open_stream` runs every other step that can refuse the
request and waits for the first engine output, so the front ends answer a
refusal with its proper status (400, 404, 429, 503) before any byte of a
stream is sent. Whatever fails after that ends the request with an error
too: no choice's task dies unseen (`ResponseStream._pump`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from gateway.admission import AdmissionController, Rejected, Ticket
from gateway.choice import ChoiceState
from gateway.config import GatewayConfig
from gateway.engine_call import prefill, stream_choice
from gateway.errors import (
    GatewayError,
    StreamBroken,
    bad_request,
    client_error,
    internal,
    model_not_found,
    rate_limited,
    unauthenticated,
    unavailable,
)
from gateway.metrics import GatewayMetrics
from gateway.model import PromptError, ServedModel
from gateway.pods import Pod, PodPool
from gateway.priority import PriorityClass, PriorityClasses, PriorityClassError
from gateway.request import ChoiceUpdate, GenerationRequest, SamplingOptions, Usage
from gateway.router import Router, ScoredPod
from gateway.tenants import AuthError, Tenant, TenantRegistry
from kv_store.block_hash import hash_request_tokens
from tessera.internal_channel import InternalClient
from tessera.roles import POD_ROLES
from tessera.tracing import tracer
from tessera.v1 import engine_pb2 as epb

logger = logging.getLogger(__name__)
_tracer = tracer("tessera.gateway")


@dataclasses.dataclass
class _Plan:
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
        self.pool = PodPool(config.router, config.admission, on_change=self._on_pool_change, client=internal)
        self.admission = AdmissionController(
            max_queue_len=config.admission.max_queue_len, queue_timeout_s=config.admission.queue_timeout_s
        )
        self.router = Router(self.pool, config.router, config.admission, model.block_size)
        self._queue_gauge_dirty = False

    def _on_pool_change(self) -> None:
        # Until a pod has reported, capacity is unknown: do not hold requests back.
        if any(p.load is not None for p in self.pool.pods.values()):
            self.admission.set_capacity(self.pool.free_slots())
        for role in POD_ROLES:
            self.metrics.pods_routable.labels(role).set(len(self.pool.routable(role)))

    async def close(self) -> None:
        await self.pool.close()

    # -- the pipeline ----------------------------------------------------
    async def open_stream(self, req: GenerationRequest, tenant: Tenant, endpoint: str) -> ResponseStream:
        """The request admitted, routed and answering (its first output
        read); raises GatewayError for every refusal. `tenant` comes from
        `authenticate`, which the front ends call before they read the body."""
        arrival = time.monotonic()
        labels = (tenant.name, req.priority_class or tenant.priority_class or self.classes.default.name)
        try:
            pclass, prompt_ids, max_tokens = self._validate(req, tenant)
            labels = (tenant.name, pclass.name)
            if not self.pool.routable():
                raise unavailable("no engine pod is serving; retry shortly", "no_engine_pod")
            ticket = await self._admit(tenant, pclass, len(prompt_ids), req.options.n * max_tokens)
        except GatewayError as e:
            self.metrics.requests.labels(*labels, endpoint, "rejected").inc()
            raise e from None
        stream = ResponseStream(self, req, tenant, pclass, prompt_ids, max_tokens, ticket, arrival, endpoint)
        try:
            await stream.start()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    def authenticate(self, authorization: str | None) -> Tenant:
        try:
            return self.tenants.authenticate(authorization)
        except AuthError as e:
            self.metrics.rejections.labels("", "", "unauthenticated").inc()
            raise unauthenticated(str(e)) from None

    def _validate(self, req: GenerationRequest, tenant: Tenant) -> tuple[PriorityClass, list[int], int]:
        if req.model != self.model.name:
            raise model_not_found(req.model, self.model.name)
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
        return pclass, prompt_ids, max_tokens

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
            return self.model.encode_chat(req.messages, req.add_generation_prompt)
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        return self.model.encode(req.prompt or "")

    async def _admit(self, tenant: Tenant, pclass: PriorityClass, num_prompt_tokens: int,
                     max_output_tokens: int) -> Ticket:
        with _tracer.start_as_current_span("gateway.admission") as span:
            span.set_attribute("tessera.tenant", tenant.name)
            span.set_attribute("tessera.priority_class", pclass.name)
            try:
                return await self.admission.admit(tenant, pclass, num_prompt_tokens, max_output_tokens)
            except Rejected as e:
                self.metrics.rejections.labels(tenant.name, pclass.name, e.reason).inc()
                span.set_attribute("tessera.rejected", e.reason)
                if e.reason == "queue_timeout":
                    raise unavailable(e.message, e.reason, e.retry_after) from None
                raise rate_limited(e.message, e.reason, e.retry_after) from None
            finally:
                if self.admission.queue_len or self._queue_gauge_dirty:
                    self._update_queue_gauge()

    def _update_queue_gauge(self) -> None:
        # Skipped while the queue stays empty (the common case): one update
        # after it drains sets the gauges back to 0.
        self._queue_gauge_dirty = self.admission.queue_len > 0
        by_class = self.admission.queue_len_by_class()
        for pclass in self.classes:
            self.metrics.queue_length.labels(pclass.name).set(by_class.get(pclass.name, 0))

    async def plan(self, prompt_ids: list[int], cache_salt: str, request_id: str) -> _Plan:
        """Rank pods for the request; decide on P/D disaggregation."""
        with _tracer.start_as_current_span("gateway.route") as span:
            hashes = hash_request_tokens(prompt_ids, self.model.block_size, cache_salt)
            key = hashes[0] if hashes else request_id.encode()
            if self.pool.disaggregated:
                plan = await self._plan_disaggregated(hashes, len(prompt_ids), key)
            else:
                ranked = await self.router.rank("mixed", hashes, len(prompt_ids), key)
                if not ranked:  # only P/D pods, one pool down: decode pods compute prompts themselves
                    ranked = await self.router.rank("decode", hashes, len(prompt_ids), key)
                plan = self._plan_from(ranked, [])
            if not plan.candidates:
                raise unavailable("no engine pod is serving; retry shortly", "no_engine_pod")
            span.set_attribute("tessera.pod", plan.candidates[0].address)
            span.set_attribute("tessera.prefix_hit_tokens", plan.matched_tokens)
            span.set_attribute("tessera.disaggregated", bool(plan.prefill_candidates))
            self.metrics.prefix_hit_tokens.labels(plan.candidates[0].address).inc(plan.matched_tokens)
            return plan

    async def _plan_disaggregated(self, hashes: list[bytes], num_tokens: int, key: bytes) -> _Plan:
        decode = await self.router.rank("decode", hashes, num_tokens, key)
        matched = decode[0].matched_blocks * self.model.block_size if decode else 0
        if num_tokens - matched < self.config.disaggregation.min_uncached_tokens:
            return self._plan_from(decode, [])
        prefill_ranked = await self.router.rank("prefill", hashes, num_tokens, key)
        return self._plan_from(decode, [s.pod for s in prefill_ranked])

    def _plan_from(self, ranked: list[ScoredPod], prefill_pods: list[Pod]) -> _Plan:
        matched = ranked[0].matched_blocks * self.model.block_size if ranked else 0
        return _Plan([s.pod for s in ranked], prefill_pods, matched)


class ResponseStream:
    """One admitted request in flight: its choices' tasks and their merged updates."""

    def __init__(self, gateway: Gateway, req: GenerationRequest, tenant: Tenant, pclass: PriorityClass,
                 prompt_ids: list[int], max_tokens: int, ticket: Ticket, arrival: float, endpoint: str) -> None:
        self.gateway = gateway
        self.req = req
        self.id = req.request_id
        self.tenant = tenant
        self.pclass = pclass
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.ticket = ticket
        self.arrival = arrival
        self.endpoint = endpoint
        self.created = int(time.time())
        self.choices = [ChoiceState(i, gateway.model.tokenizer, prompt_ids, req.options)
                        for i in range(req.options.n)]
        # One choice without P/D (the common case) is read inline; otherwise
        # each choice (and the prefill) runs as a task feeding the queue.
        self._single: AsyncIterator[ChoiceUpdate] | None = None
        self._updates: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._first: ChoiceUpdate | None = None
        self._first_token_time: float | None = None
        self._remaining = req.options.n
        self._closed = False
        self.outcome = "ok"

    @property
    def labels(self) -> tuple[str, str]:
        return self.tenant.name, self.pclass.name

    @property
    def usage(self) -> Usage:
        cached = self.choices[0].num_cached_tokens or 0
        return Usage(len(self.prompt_ids), sum(c.num_tokens for c in self.choices), cached)

    async def start(self) -> None:
        g = self.gateway
        plan = await g.plan(self.prompt_ids, self.tenant.cache_salt, self.id)
        metadata = [("x-tessera-tenant", self.tenant.name)]
        prefill_task = None
        if plan.prefill_candidates:
            request = self._engine_request(0, plan)
            prefill_task = asyncio.create_task(
                prefill(g.pool, plan.prefill_candidates, request, metadata, self._on_attempt("prefill"))
            )
            self._tasks.append(prefill_task)
        if len(self.choices) == 1 and prefill_task is None:
            self._single = self._choice_updates(self.choices[0], plan, metadata, None)
        else:
            for choice in self.choices:
                updates = self._choice_updates(choice, plan, metadata, prefill_task)
                self._tasks.append(asyncio.create_task(self._pump(updates)))
        # Wait for the first output (or the refusal) before the front end answers.
        try:
            self._first = await self._next_update()
        except BaseException:
            self.outcome = "error"
            raise
        if self._first is None:
            self.outcome = "error"
            raise internal("internal error: the request produced no output")

    def _engine_request(self, index: int, plan: _Plan, consume: bool = False) -> epb.GenerateRequest:
        req = epb.GenerateRequest(
            request_id=f"{self.id}-{index}",
            prompt_token_ids=self.prompt_ids,
            sampling_params=self.req.options.to_engine(self.max_tokens, index),
            priority=self.pclass.priority,
            cache_salt=self.tenant.cache_salt,
        )
        if consume:
            req.kv_transfer.mode = epb.KVTransferParams.MODE_CONSUME
        return req

    def _on_attempt(self, kind: str):
        def record(pod: Pod, attempt: int) -> None:
            pod.dispatched_since_report += 1
            self.gateway.metrics.routing.labels(pod.address, pod.role, "retry" if attempt else kind).inc()
            if attempt:
                self.gateway.metrics.retries.inc()
        return record

    async def _choice_updates(self, choice: ChoiceState, plan: _Plan, metadata,
                              prefill_task) -> AsyncIterator[ChoiceUpdate]:
        """One choice's updates until it finishes; raises GatewayError or
        StreamBroken when its engine calls fail. Every step (building the
        engine request, the call, detokenizing) is inside the `try`: a bug
        anywhere ends the request with a 500, logged here once."""
        responses = None
        try:
            consume = False
            if prefill_task is not None:
                consume = await asyncio.shield(prefill_task)
            request = self._engine_request(choice.index, plan, consume)
            kind = "decode" if prefill_task is not None else "route"
            responses = stream_choice(self.gateway.pool, plan.candidates, request, metadata, self._on_attempt(kind))
            async for response in responses:
                update = choice.on_response(response)
                self.ticket.charge_output_tokens(len(response.token_ids))
                yield update
                if choice.finished:
                    return
            raise StreamBroken("the engine stream ended before the choice finished")
        except (GatewayError, StreamBroken, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # a bug: end this request with 500, keep the gateway up
            logger.exception("request %s choice %d failed", self.id, choice.index)
            raise internal(f"internal error: {type(e).__name__}") from e
        finally:
            if responses is not None:
                await responses.aclose()

    async def _pump(self, updates: AsyncIterator[ChoiceUpdate]) -> None:
        """Feed one choice's updates to the merged queue. Whatever ends it
        other than cancellation reaches the consumer, which would otherwise
        wait for this choice forever."""
        try:
            async for update in updates:
                await self._updates.put(update)
        except (GatewayError, StreamBroken) as e:
            self._updates.put_nowait(e)
        except Exception as e:
            self._updates.put_nowait(client_error(e, "mid-request"))

    async def _next_update(self) -> ChoiceUpdate | None:
        """The next update of any choice; None when a lone choice's updates
        ended without a finish (the caller raises)."""
        if self._single is not None:
            try:
                return await self._single.__anext__()
            except StopAsyncIteration:
                return None
        item = await self._updates.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def __aiter__(self) -> AsyncIterator[ChoiceUpdate]:
        """Updates of every choice as they come; raises StreamBroken (or a
        GatewayError) if an engine fails mid-stream."""
        try:
            if self._first is not None:
                first, self._first = self._first, None
                self._on_update(first)
                yield first
            while self._remaining > 0:
                item = await self._next_update()
                if item is None:
                    raise internal("internal error: a choice ended without finishing")
                self._on_update(item)
                yield item
        except Exception:  # GatewayError, StreamBroken, or a bug the front end reports as 500
            self.outcome = "error"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            self.outcome = "cancelled"
            raise
        finally:
            await self.aclose()

    def _on_update(self, update: ChoiceUpdate) -> None:
        if self._first_token_time is None and update.token_ids:
            self._first_token_time = time.monotonic()
            self.gateway.metrics.for_request(*self.labels).ttft.observe(self._first_token_time - self.arrival)
        if update.finish_reason is not None:
            self._remaining -= 1

    async def collect(self) -> list[ChoiceUpdate]:
        """Every choice's whole output (for non-streaming answers)."""
        merged = [ChoiceUpdate(i) for i in range(len(self.choices))]
        async for update in self:
            m = merged[update.index]
            m.text += update.text
            m.token_ids += update.token_ids
            m.logprobs += update.logprobs
            m.finish_reason, m.stop_reason = update.finish_reason, update.stop_reason
        return merged

    async def aclose(self) -> None:
        """Cancel whatever still runs (aborting it on its pods), release the
        admission ticket, record the request. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._single is not None:
            await self._single.aclose()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ticket.release()
        m, labels = self.gateway.metrics, self.labels
        if self._remaining > 0 and self.outcome == "ok":
            self.outcome = "cancelled"
        m.requests.labels(*labels, self.endpoint, self.outcome).inc()
        usage, per = self.usage, m.for_request(*labels)
        per.prompt_tokens.inc(usage.prompt_tokens)
        per.generation_tokens.inc(usage.completion_tokens)
        per.cached_tokens.inc(usage.cached_tokens)
        per.e2e.observe(time.monotonic() - self.arrival)
