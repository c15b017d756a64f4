"""One admitted request in flight (`ResponseStream`): its choices' engine
calls (with the prefill of a P/D request), their merged updates, and the
request's metrics and admission ticket when it ends.

`Gateway.open_stream` (gateway/serving.py) makes one and waits in `start`
for its first output, so a refusal by the engine (a constraint the grammar
compiler rejects, say) is a status before any byte is streamed. Whatever
fails after that ends the request with an error too: no choice's task dies
unseen (`_pump`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from opentelemetry import trace

from gateway.admission import Ticket
from gateway.choice import ChoiceState
from gateway.engine_call import prefill, stream_choice
from gateway.errors import EngineRefused, GatewayError, StreamBroken, client_error, internal
from gateway.pods import Pod
from gateway.priority import PriorityClass
from gateway.rejections import is_refusal, rejection_reason
from gateway.request import ChoiceUpdate, GenerationRequest, Usage
from gateway.request_span import record_response
from gateway.structured_output import engine_refusal
from gateway.tenants import Tenant
from tessera.v1 import engine_pb2 as epb

if TYPE_CHECKING:
    from gateway.serving import Gateway, Plan

logger = logging.getLogger(__name__)


class ResponseStream:
    """One admitted request in flight: its choices' tasks and their merged updates."""

    def __init__(self, gateway: Gateway, req: GenerationRequest, tenant: Tenant, pclass: PriorityClass,
                 prompt_ids: list[int], max_tokens: int, ticket: Ticket, arrival: float, endpoint: str,
                 lora_name: str = "") -> None:
        self.gateway = gateway
        self.req = req
        # The LoRA adapter the engine runs it on ("" for the base model): req.model, resolved.
        self.lora_name = lora_name
        self.id = req.request_id
        self.tenant = tenant
        self.pclass = pclass
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.ticket = ticket
        self.arrival = arrival
        self._dispatched = False  # the first engine call is sent (tessera_gateway_dispatch_seconds)
        # However often it is routed again (_replan), the request waits for a pod until then at most.
        self._pod_deadline = time.monotonic() + gateway.config.admission.queue_timeout_s
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
        # The request's SERVER span (current while open_stream builds this): its answer is
        # recorded there when the request ends, which for a stream is after the handler returned.
        self._span = trace.get_current_span()
        self._finish_reasons: list[str] = []

    @property
    def labels(self) -> tuple[str, str]:
        return self.tenant.name, self.pclass.name

    @property
    def usage(self) -> Usage:
        cached = self.choices[0].num_cached_tokens or 0
        return Usage(len(self.prompt_ids), sum(c.num_tokens for c in self.choices), cached)

    async def start(self) -> None:
        g = self.gateway
        plan = await g.plan(self.prompt_ids, self.tenant.cache_salt, self.id, self._pod_deadline, self.lora_name)
        metadata = [("x-tessera-tenant", self.tenant.name)]
        prefill_task = None
        if plan.prefill_candidates:
            request = self._engine_request(0, plan)
            # Direct: pushed to the decode pod ranked first, where the choices go unless it fails.
            target = plan.candidates[0].address if g.config.disaggregation.kv_channel == "direct" else ""
            prefill_task = asyncio.create_task(
                prefill(g.pool, plan.prefill_candidates, request, metadata, self._on_attempt("prefill"), target)
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
        except GatewayError as e:
            if is_refusal(e) and not e.counted:  # an engine pod refused it at submit (a 4xx): a rejection
                self.outcome, e.counted = "rejected", True  # aclose counts the request by its outcome
                g.metrics.rejections.labels(*self.labels, rejection_reason(e)).inc()
            else:
                self.outcome = "error"
            raise
        except BaseException:
            self.outcome = "error"
            raise
        if self._first is None:
            self.outcome = "error"
            raise internal("internal error: the request produced no output")

    def _engine_request(self, index: int, plan: Plan, consume: bool = False) -> epb.GenerateRequest:
        req = epb.GenerateRequest(
            request_id=f"{self.id}-{index}",
            prompt_token_ids=self.prompt_ids,
            sampling_params=self.req.options.to_engine(self.max_tokens, index),
            priority=self.pclass.priority,
            cache_salt=self.tenant.cache_salt,
            lora_name=self.lora_name,
        )
        if consume:
            req.kv_transfer.mode = epb.KVTransferParams.MODE_CONSUME
        return req

    def _on_attempt(self, kind: str):
        def record(pod: Pod, attempt: int) -> None:
            if not self._dispatched:
                self._dispatched = True
                added = time.monotonic() - self.arrival - self.ticket.queue_wait_s
                self.gateway.metrics.dispatch.observe(max(0.0, added))
            pod.dispatched_since_report += 1
            if pod.role != "prefill":  # the pods admission capacity counts (PodPool.free_slots)
                self.ticket.placed()
            self.gateway.metrics.routing.labels(pod.address, pod.role, "retry" if attempt else kind).inc()
            if attempt:
                self.gateway.metrics.retries.inc()
        return record

    async def _choice_updates(self, choice: ChoiceState, plan: Plan, metadata,
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
            replan = self._replan if self.gateway.config.admission.queue_without_pods else None
            responses = stream_choice(self.gateway.pool, plan.candidates, request, metadata, self._on_attempt(kind),
                                      replan)
            async for response in responses:
                update = choice.on_response(response)
                self.ticket.charge_output_tokens(len(response.token_ids))
                yield update
                if choice.finished:
                    return
            raise StreamBroken("the engine stream ended before the choice finished")
        except EngineRefused as e:  # at submit: a constraint only the grammar compiler could judge, say
            raise engine_refusal(e, self.req.options.structured_outputs_param) from None
        except (GatewayError, StreamBroken, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # a bug: end this request with 500, keep the gateway up
            logger.exception("request %s choice %d failed", self.id, choice.index)
            raise internal(f"internal error: {type(e).__name__}") from e
        finally:
            if responses is not None:
                await responses.aclose()

    async def _replan(self) -> list[Pod]:
        """New candidates for a request no pod has run yet (its pods left or
        refused it: a pool scaled down to zero as it was routed), waiting for
        a pod until the first plan's deadline (Gateway.plan raises then)."""
        plan = await self.gateway.plan(self.prompt_ids, self.tenant.cache_salt, self.id, self._pod_deadline,
                                       self.lora_name)
        return plan.candidates

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
            self._finish_reasons.append(update.finish_reason)

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
        # Resolved when it was admitted: a served model's name, never arbitrary client input.
        m.model_requests.labels(self.req.model, self.endpoint, self.outcome).inc()
        usage, per = self.usage, m.for_request(*labels)
        record_response(self._span, self._finish_reasons, usage.prompt_tokens, usage.completion_tokens)
        per.prompt_tokens.inc(usage.prompt_tokens)
        per.generation_tokens.inc(usage.completion_tokens)
        per.cached_tokens.inc(usage.cached_tokens)
        per.e2e.observe(time.monotonic() - self.arrival)
