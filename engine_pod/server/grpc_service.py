"""The tessera.v1.Engine gRPC service over the async engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid

import grpc
from opentelemetry.trace import SpanKind

from engine_pod.processor import Processor
from engine_pod.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    StepOutput,
    StreamEnd,
)
from engine_pod.server.convert import request_from_proto, response_from_output
from engine_pod.server.lora_registry import (
    AdapterConflict,
    AdapterOutsideRoots,
    LoRADisabled,
    LoRARegistry,
    TooManyAdapters,
)
from engine_pod.server.metrics import EngineMetrics
from engine_pod.server.prefix_cache_feed import PrefixCacheFeed
from kv_store.inbox_socket import InboxBusy, InboxConfig, InboxSocket
from kv_store.tiered_store import TieredKVStore
from tessera.tracing import (
    GEN_AI_REQUEST_MAX_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_REQUEST_TEMPERATURE,
    GEN_AI_REQUEST_TOP_P,
    GEN_AI_RESPONSE_FINISH_REASONS,
    GEN_AI_RESPONSE_ID,
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
    end_rpc_span,
    parent_context,
    server_call_code,
    start_rpc_span,
    tracer,
)
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
GENERATE = "tessera.v1.Engine/Generate"
# A push's deadlines (idle and in all): a stalled, dead or hostile prefill pod
# holds no call open. A long prompt's chunks come much faster.
PUSH_LIMITS = InboxConfig()


class EngineService(pb_grpc.EngineServicer):
    def __init__(self, processor: Processor, metrics: EngineMetrics, role: str, max_waiting_requests: int,
                 adapters: LoRARegistry | None = None) -> None:
        # Attached once the model is loaded; until then the pod is not serving.
        self.engine: AsyncEngine | None = None
        self.processor = processor
        self.metrics = metrics
        self.role = role
        self.max_waiting_requests = max_waiting_requests
        self.serving = False  # flipped by the server after warm-up, and back when draining
        self.stalled = False  # one engine step has run past --step-timeout (step_watchdog.py)
        self.adapters = adapters or LoRARegistry(processor, [])
        self.inbox_socket: InboxSocket | None = None  # the pushes' fast data path (--kv-inbox-port)

    def attach(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        # Not made current: grpc closes a cancelled stream's generator from
        # another context, where a context attached here cannot be detached
        # (opentelemetry logs that as an ERROR traceback on every cancel).
        span = start_rpc_span(tracer(), GENERATE, SpanKind.SERVER, parent_context(context.invocation_metadata()))
        error, finished = None, False
        try:
            # aclosing: a close at the yield below reaches _generate's own (the abort on the engine).
            async with contextlib.aclosing(self._generate(request, context, span)) as responses:
                async for response in responses:
                    finished = bool(response.finish_reason)
                    yield response
        except BaseException as e:  # an abort, the caller gone, a bug: each gets its code
            # The gateway cancels a call once it has read the last response:
            # no failure, the call did its work.
            if not (finished and isinstance(e, (GeneratorExit, asyncio.CancelledError))):
                error = e
            raise
        finally:
            end_rpc_span(span, server_call_code(context, error), context.details() or "")

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, span):
        if not self.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine pod is not serving (starting or draining)")
        if self.engine.num_queued() >= self.max_waiting_requests:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"waiting queue is full ({self.max_waiting_requests} requests); retry later or elsewhere",
            )
        request_id = request.request_id or uuid.uuid4().hex
        if self.engine.has_request(request_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")
        adapter = None
        if request.lora_name:
            adapter = self.adapters.lookup(request.lora_name)
            if adapter is None:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"LoRA adapter {request.lora_name[:256]!r} is not served by this pod")
        try:
            engine_request = request_from_proto(
                request, request_id, self.processor, self.role, self.processor.config.kv_store.redis_url is not None,
                adapter,
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NotImplementedError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

        arrival = time.time()
        params = request.sampling_params
        span.set_attributes({
            "tessera.request_id": request_id, GEN_AI_RESPONSE_ID: request_id,
            GEN_AI_USAGE_INPUT_TOKENS: engine_request.num_prompt_tokens,
            GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens, GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            GEN_AI_REQUEST_TOP_P: params.top_p,
        })
        if request.lora_name:
            span.set_attribute(GEN_AI_REQUEST_MODEL, request.lora_name)
        try:
            queue = self.engine.add_request(engine_request)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        stream = _RequestStream(request_id, engine_request.num_prompt_tokens, arrival, self.metrics, span,
                                request.lora_name or None)
        if stream.lora_name:
            self.metrics.on_lora_request(stream.lora_name)
        pushes = engine_request.kv_transfer_target is not None
        try:
            while True:
                item = await queue.get()
                response = stream.on_item(item)
                if response is not None:
                    if pushes and response.finish_reason and stream.error is None and response.finish_reason != "abort":
                        # The gateway sends the decode request when this
                        # answer arrives: the blocks must be there first.
                        await self._await_push(request_id, span)
                    yield response
                if stream.done:
                    break
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away (a cancel, a deadline, a closed
            # channel): expected, so no traceback; free its KV blocks now.
            # CancelledError while waiting for the engine, GeneratorExit
            # when grpc closes the stream suspended at a yield.
            logger.debug("request %s: cancelled by the client", request_id)
            self.engine.abort(request_id)
            stream.finish("abort", time.time())
            raise
        finally:
            store = self._store()
            if pushes and store is not None:
                store.cancel_transfer(request_id)  # a no-op once its push finished
        if stream.error is not None:
            await context.abort(grpc.StatusCode.INTERNAL, f"engine failed: {stream.error!r}")

    def _store(self) -> TieredKVStore | None:
        return self.engine.core.kv_store if self.engine is not None else None

    async def _await_push(self, request_id: str, span) -> None:
        """Wait until a producing request's blocks reached its decode pod (or
        Redis, when the direct push failed); bounded, never an error: a
        decode pod that finds no blocks computes the prompt itself."""
        store = self._store()
        future = store.finish_transfer(request_id) if store is not None else None
        if future is None:
            return
        bound = store.sender.config.timeout_s * 2 + 10  # the push's deadline, then the fallback's write
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), bound)
        except (TimeoutError, concurrent.futures.CancelledError):
            logger.warning("request %s: its KV push did not finish within %.0f s", request_id, bound)
            return
        span.set_attributes({"tessera.kv_transfer.channel": result.channel,
                             "tessera.kv_transfer.blocks": result.num_blocks,
                             "tessera.kv_transfer.bytes": result.num_bytes,
                             "tessera.kv_transfer.seconds": result.seconds})

    async def PushKVBlocks(self, request_iterator, context) -> pb.PushKVBlocksReply:
        """Take a prefill pod's pushed blocks into this pod's inbox (see the proto)."""
        store = await self._inbox_store(context)
        received = 0
        messages = request_iterator.__aiter__()
        loop = asyncio.get_running_loop()
        end = loop.time() + PUSH_LIMITS.max_transfer_s
        while True:
            try:
                # A sender that stalls holds the call no longer than this between messages, nor in all.
                wait = min(PUSH_LIMITS.idle_timeout_s, end - loop.time())
                message = await asyncio.wait_for(messages.__anext__(), max(wait, 0.0))
            except StopAsyncIteration:
                break
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"push abandoned: no KV block for {PUSH_LIMITS.idle_timeout_s:.0f} s, "
                                    f"or longer than {PUSH_LIMITS.max_transfer_s:.0f} s in all")
            try:
                store.receive([(b.block_hash, b.value) for b in message.blocks])
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            received += len(message.blocks)
        return pb.PushKVBlocksReply(num_blocks=received)

    async def OpenKVInbox(self, request: pb.OpenKVInboxRequest, context) -> pb.OpenKVInboxReply:
        """A one-time ticket for this pod's inbox socket; port 0 when it has none (see the proto)."""
        await self._inbox_store(context)
        inbox = self.inbox_socket
        if inbox is None:
            return pb.OpenKVInboxReply(port=0)
        try:
            ticket = inbox.issue_ticket(request.transfer_id[:256])
        except InboxBusy as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; push over PushKVBlocks instead")
        return pb.OpenKVInboxReply(port=inbox.port, ticket=ticket,
                                   expires_in_ms=int(inbox.config.ticket_ttl_s * 1000))

    async def _inbox_store(self, context) -> TieredKVStore:
        """This pod's store, if it takes pushes; the call is refused otherwise."""
        store = self._store()
        if self.role == "prefill":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a prefill pod takes no pushed KV blocks")
        if store is None or store.inbox is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this pod takes no pushed KV blocks (--kv-inbox-bytes is 0)")
        return store

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        if self.engine is None:
            return pb.AbortResponse()
        return pb.AbortResponse(aborted=[rid for rid in request.request_ids if self.engine.abort(rid)])

    def _load_report(self, request: pb.LoadRequest) -> pb.LoadReport:
        if self.engine is None:
            return pb.LoadReport(role=self.role, serving=False)
        snap = self.engine.snapshot
        core = self.engine.core
        return pb.LoadReport(
            role=self.role,
            num_running=snap.num_running,
            # What the gateway weighs a pod by: background requests yield to the ones it routes.
            num_waiting=self.engine.num_queued_foreground(),
            kv_cache_usage=snap.kv_cache_usage_foreground,
            num_pending_prefill_tokens=self.engine.num_pending_prefill_tokens(),
            num_kv_blocks=core.num_blocks,
            num_free_kv_blocks=snap.num_free_blocks,
            block_size=core.block_size,
            matched_prefix_blocks=self.engine.num_cached_prefix_blocks(request.block_hashes),
            serving=self.serving,
            stalled=self.stalled,
            lora_adapters=self._adapter_list(),
        )

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest, context) -> pb.LoRAAdapterList:
        try:
            # The check reads the adapter's files: off the frontend's event loop.
            await asyncio.to_thread(self.adapters.register, request.lora_name, request.lora_path)
        except AdapterOutsideRoots as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except AdapterConflict as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except LoRADisabled as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except TooManyAdapters as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        logger.info("LoRA adapter %r loaded from %s", request.lora_name, request.lora_path)
        return pb.LoRAAdapterList(adapters=self._adapter_list())

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest, context) -> pb.LoRAAdapterList:
        try:
            self.adapters.unregister(request.lora_name)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"LoRA adapter {request.lora_name[:256]!r} is not served by this pod")
        logger.info("LoRA adapter %r unloaded", request.lora_name)
        return pb.LoRAAdapterList(adapters=self._adapter_list())

    def _adapter_list(self) -> list[pb.LoRAAdapter]:
        loader = self.engine.core.lora_loader if self.engine is not None else None
        resident = loader.resident_ids if loader is not None else frozenset()
        return [pb.LoRAAdapter(name=s.name, fingerprint=s.fingerprint, resident=s.lora_int_id in resident)
                for s in self.adapters.adapters()]

    async def GetLoad(self, request: pb.LoadRequest, context) -> pb.LoadReport:
        return self._load_report(request)

    async def StreamLoad(self, request: pb.LoadRequest, context):
        if request.interval_ms < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "interval_ms must be >= 0")
        interval = (request.interval_ms or 1000) / 1000
        feed = PrefixCacheFeed() if request.prefix_cache_keys else None
        while True:
            if feed is None:
                yield self._load_report(request)
            else:
                # A set too large for one report continues in the next ones, sent at once.
                for keys in feed.next_messages(self.engine.core.prefix_cache_keys if self.engine else None):
                    report = self._load_report(request)
                    report.prefix_cache.CopyFrom(keys)
                    yield report
            await asyncio.sleep(interval)


class _RequestStream:
    """Turns one request's engine outputs into responses, metrics and span events."""

    def __init__(self, request_id: str, num_prompt_tokens: int, arrival: float, metrics: EngineMetrics, span,
                 lora_name: str | None = None) -> None:
        self.request_id = request_id
        self.lora_name = lora_name
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = arrival
        self.metrics = metrics
        self.span = span
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_output_tokens = 0
        self.done = False
        self.error: BaseException | None = None

    def on_item(self, item: StepOutput | StreamEnd) -> pb.GenerateResponse | None:
        if isinstance(item, StreamEnd):
            self.error = item.error
            self.finish(item.reason, time.time())
            if item.reason == "abort":
                return pb.GenerateResponse(request_id=self.request_id, finish_reason="abort")
            return None
        out, now = item.output, item.step_end_time
        if self.first_token_time is None:
            self.first_token_time = now
            scheduled = out.first_scheduled_time
            if scheduled is not None:
                self.span.add_event("scheduled", timestamp=int(scheduled * 1e9))
            self.span.add_event("first_token", timestamp=int(now * 1e9))
            self.span.set_attribute("tessera.cached_tokens", out.num_cached_tokens)
            self.metrics.on_first_token(self.num_prompt_tokens, self.arrival, scheduled, now)
            since_last = None
        else:
            since_last = now - self.last_token_time
        self.last_token_time = now
        self.num_output_tokens += len(out.new_token_ids)
        self.metrics.on_tokens(len(out.new_token_ids), since_last)
        if self.lora_name:
            self.metrics.on_lora_tokens(self.lora_name, len(out.new_token_ids))
        response = response_from_output(out, self.num_prompt_tokens)
        response.timing.CopyFrom(pb.Timing(
            arrival_time=self.arrival,
            first_scheduled_time=out.first_scheduled_time or 0.0,
            first_token_time=self.first_token_time,
            last_token_time=now,
        ))
        if out.finished:
            self.finish(out.finish_reason, now)
        return response

    def finish(self, reason: str, now: float) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.on_finished(reason, self.arrival, now)
        self.span.set_attribute(GEN_AI_USAGE_OUTPUT_TOKENS, self.num_output_tokens)
        self.span.set_attribute(GEN_AI_RESPONSE_FINISH_REASONS, [reason])
        self.span.add_event("finished", timestamp=int(now * 1e9))
