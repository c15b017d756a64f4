"""Calls to engine pods: one choice's generation with a retry before the
first token, and the prefill half of a P/D request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import grpc
from opentelemetry.trace import SpanKind

from gateway.errors import GatewayError, StreamBroken, engine_refused, model_not_found, unavailable
from gateway.pods import Pod, PodPool
from gateway.pods.deadline import NoProgress, ProgressDeadline
from tessera.tracing import (
    GEN_AI_RESPONSE_FINISH_REASONS,
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
    end_rpc_span,
    inject_metadata,
    start_rpc_span,
    tracer,
)
from tessera.v1 import engine_pb2 as epb

logger = logging.getLogger(__name__)
_tracer = tracer("tessera.gateway")
GENERATE = "tessera.v1.Engine/Generate"

# The engine refused the request itself: retrying elsewhere cannot help.
_CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS}
# Attempts that reached a pod and failed there (a stall, an internal error):
# the pod may have spent time on the request, and a third try rarely helps.
MAX_ATTEMPTS = 2
# Attempts a pod refused or never took (UNAVAILABLE before any response: the
# pod is down or draining). The request did not run, so trying further costs
# little; this many lets it get past a whole failed node of pods whose
# ejection has not reached the plan yet.
MAX_REFUSED_ATTEMPTS = 8


def _engine_error(e: grpc.aio.AioRpcError) -> GatewayError:
    if e.code() in _CLIENT_ERRORS:
        return engine_refused(e.details() or e.code().name)
    return unavailable(f"engine pod failed: {e.code().name}: {e.details()}", "engine_unavailable")


class _AttemptBudget:
    """Which failures end the retries: MAX_ATTEMPTS failures at a pod, or
    MAX_REFUSED_ATTEMPTS refusals."""

    def __init__(self) -> None:
        self.failed = 0
        self.refused = 0

    def spend(self, refused: bool) -> None:
        if refused:
            self.refused += 1
        else:
            self.failed += 1

    @property
    def left(self) -> bool:
        return self.failed < MAX_ATTEMPTS and self.refused < MAX_REFUSED_ATTEMPTS


def _still_routable(candidates: list[Pod], budget: _AttemptBudget) -> Iterator[Pod]:
    """Candidates while the budget lasts, each checked when its turn comes:
    one ejected since the plan was made (a retry after a stall, a decode
    after its prefill, a pod of a node that just died) is skipped."""
    for pod in candidates:
        if not budget.left:
            return
        if pod.routable:
            yield pod


async def _attempts(candidates: list[Pod], budget: _AttemptBudget,
                    replan: Callable[[], Awaitable[list[Pod]]] | None) -> AsyncIterator[Pod]:
    """The pods to try in turn: the candidates still routable, then, while
    no pod has run the request (every one tried refused it or had left),
    those of a new plan: a request routed to the last pods of a pool as
    they were scaled away waits for the next (`replan` waits for a pod,
    within the request's deadline, and raises when none comes)."""
    while True:
        for pod in _still_routable(candidates, budget):
            yield pod
        if replan is None or budget.failed or not budget.left:
            return
        candidates = await replan()


async def stream_choice(
    pool: PodPool, candidates: list[Pod], request: epb.GenerateRequest, metadata: list[tuple[str, str]],
    on_attempt: Callable[[Pod, int], None], replan: Callable[[], Awaitable[list[Pod]]] | None = None,
) -> AsyncIterator[epb.GenerateResponse]:
    """Responses of one engine request. A pod that fails before its first
    response is ejected and the request goes to the next candidate (see
    _AttemptBudget for how many);
    after the first response a failure raises StreamBroken. Each response
    must come within `router.stream_idle_timeout_s`, and the pool ends the
    call at once if the pod stalls (gateway/pods/deadline.py): the same
    failure, retried or StreamBroken. With `replan`, a request no pod has
    run yet goes on to a new plan's candidates (_attempts). Cancelling the
    consumer cancels the call, which aborts the request on the pod."""
    last_error: GatewayError | None = None
    budget = _AttemptBudget()
    attempt = -1
    async with contextlib.aclosing(_attempts(candidates, budget, replan)) as attempts:
        async for pod in attempts:
            attempt += 1
            on_attempt(pod, attempt)
            started = False
            call = None
            # Not made current: an async generator may be closed from another
            # task, where the context it attached could not be detached.
            span = start_rpc_span(_tracer, GENERATE, SpanKind.CLIENT)
            span.set_attributes({"tessera.pod": pod.address, "tessera.attempt": attempt,
                                 GEN_AI_USAGE_INPUT_TOKENS: len(request.prompt_token_ids)})
            # CANCELLED unless the call ends otherwise: the consumer stopped early.
            code, details, num_output_tokens = grpc.StatusCode.CANCELLED, "", 0
            deadline = ProgressDeadline(pool.router_config.stream_idle_timeout_s, "response from the engine pod",
                                        pool.loop_lag)
            pod.calls.add(deadline)
            try:
                call = pod.stub.Generate(request, metadata=inject_metadata(list(metadata), span))
                while (response := await deadline.read(call)) is not grpc.aio.EOF:
                    if not started:
                        started = True
                        span.add_event("first_token")
                    num_output_tokens += len(response.token_ids)
                    if response.finish_reason:
                        code = grpc.StatusCode.OK
                        span.set_attribute(GEN_AI_RESPONSE_FINISH_REASONS, [response.finish_reason])
                    yield response
                    if response.finish_reason:
                        return
                code, details = grpc.StatusCode.INTERNAL, "engine stream ended without a finish reason"
                raise StreamBroken(details)
            except NoProgress as e:
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, str(e)
                last_error = unavailable(str(e), "engine_stalled")
                if started:
                    raise StreamBroken(last_error.message) from None
                budget.spend(refused=False)
                logger.warning("request %s: %s made no progress before its first token (%s); %s", request.request_id,
                               pod.address, e, "retrying" if budget.left else "giving up")
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details() or ""
                last_error = _engine_error(e)
                if e.code() == grpc.StatusCode.NOT_FOUND and request.lora_name:
                    # The pod does not serve the adapter (unloaded since its report, or never: no
                    # pod reported it). The candidates were the pods reporting it, or all when
                    # none did: the others answer the same. The client's 404, as for a name
                    # the gateway does not know.
                    pod.adapters.pop(request.lora_name, None)
                    raise model_not_found(request.lora_name) from None
                if e.code() in _CLIENT_ERRORS:
                    raise last_error from None
                if started:
                    raise StreamBroken(last_error.message) from None
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                    pool.eject(pod, f"generate: {e.code().name}")
                budget.spend(refused=e.code() == grpc.StatusCode.UNAVAILABLE)
                logger.warning("request %s: %s failed before its first token (%s); %s", request.request_id,
                               pod.address, e.code().name, "retrying" if budget.left else "giving up")
            finally:
                pod.calls.discard(deadline)
                # The consumer may stop early (a stop string, a disconnect): the
                # cancelled call aborts the request on the pod, freeing its KV.
                if call is not None and not call.done():
                    call.cancel()
                span.set_attribute(GEN_AI_USAGE_OUTPUT_TOKENS, num_output_tokens)
                # A consumer that stopped (a stop string, a disconnect) is no failure of the call.
                end_rpc_span(span, code, details, failed=None if code != grpc.StatusCode.CANCELLED else False)
    raise last_error or unavailable("no engine pod is available", "no_engine_pod")


async def prefill(pool: PodPool, candidates: list[Pod], request: epb.GenerateRequest,
                  metadata: list[tuple[str, str]], on_attempt: Callable[[Pod, int], None],
                  direct_target: str = "") -> bool:
    """Run the prompt on a prefill pod so its KV lands in the shared store
    (or, with ``direct_target``, the address of the decode pod the request
    goes to, is pushed straight to that pod). False if no prefill pod
    managed it (the decode pod then computes the prompt itself: slower,
    never wrong)."""
    produce = epb.GenerateRequest()
    produce.CopyFrom(request)
    produce.request_id = request.request_id + "-prefill"
    produce.kv_transfer.mode = epb.KVTransferParams.MODE_PRODUCE
    produce.kv_transfer.direct_target = direct_target
    try:
        async for _ in stream_choice(pool, candidates, produce, metadata, on_attempt):
            pass
        return True
    except asyncio.CancelledError:
        raise
    except (GatewayError, StreamBroken) as e:
        logger.warning("request %s: prefill failed (%s); the decode pod computes the prompt", request.request_id, e)
        return False
