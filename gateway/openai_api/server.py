"""The OpenAI-compatible REST API (FastAPI): /v1/completions,
/v1/chat/completions, /v1/models, vLLM's admin endpoints
/v1/load_lora_adapter and /v1/unload_lora_adapter, plus /health. (Metrics
have their own port: gateway/main.py.)

The OpenAPI document is served at /openapi.json. Every answer but a 2xx is
OpenAI's error object, whatever failed: the body, the key, a route or
method that does not exist, or the gateway itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from gateway import lora_admin
from gateway.batch.api import batch_router
from gateway.batch.store import BatchStore
from gateway.catalog import ModelEntry
from gateway.http_tracing import telemetry_config
from gateway.errors import (
    GatewayError,
    bad_request,
    client_error,
    http_error,
    internal,
    unavailable,
)
from gateway.openai_api.checks import authenticated_route, endpoint_label
from gateway.openai_api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    admin_error_responses,
    error_responses,
)
from gateway.openai_api.render import (
    chat_choice,
    chat_chunk_choice,
    completion_choice,
    tool_chunk_choices,
    usage_json,
)
from gateway.rejections import count_rejection
from gateway.request import GenerationRequest, TokenLogprob
from gateway.response_stream import ResponseStream
from gateway.serving import Gateway
from gateway.structured_output import constrain_to_tool_calls
from gateway.tenants import Tenant
from gateway.tool_calls import ToolCallPlan, new_choice_parser, plan_tool_calls
from gateway.tool_calls.history import HistoryCall, template_message

logger = logging.getLogger(__name__)
# How often a non-streamed request checks that its client is still there.
_DISCONNECT_POLL_S = 0.25


def error_response(e: GatewayError, extra: dict | None = None, headers: dict | None = None) -> Response:
    """OpenAI's error object; `extra`: more top-level keys beside `error`; `headers`: more
    headers (a 405's Allow)."""
    headers = dict(headers or {})
    if e.retry_after is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    # ASCII JSON: a message that quotes the client's input renders whatever it holds.
    return Response(json.dumps({**e.to_openai(), **(extra or {})}), status_code=e.status, headers=headers,
                    media_type="application/json")


def _model_json(entry: ModelEntry, max_model_len: int) -> dict:
    """vLLM's model card: an adapter's `parent` is the base model; `root` is the
    name itself (the folders live on the engine pods, not here)."""
    return {"id": entry.id, "object": "model", "created": 0, "owned_by": "tessera", "root": entry.id,
            "parent": entry.parent, "max_model_len": max_model_len}


def _admin_response(result: lora_admin.AdminResult) -> Response:
    if result.ok:
        return Response(json.dumps(result.to_json()), media_type="application/json")
    return error_response(result.error(), {"pods": [o.to_json() for o in result.outcomes]})


def _non_text_part(body) -> GatewayError | None:
    """A chat message's content part that is not text (image_url, input_audio, ...): this
    gateway serves text-only models, and pydantic's own message for it (the union's every
    failed branch) says nothing of the kind."""
    messages = body.get("messages") if isinstance(body, dict) else None
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                where = f"messages[{i}].content[{j}].type"
                return bad_request(f"{where}: content parts of type {kind[:64]!r} are not supported: this model "
                                   "takes text only", "unsupported_content_type", where)
    return None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]  # where it came from, not a field: "limit", not "query.limit"
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg')}", None
    if not loc:  # the body as a whole: not a JSON object (or sent without Content-Type: application/json)
        return "the body must be a JSON object, sent with Content-Type: application/json", None
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg')}{more}", (loc[0] if loc else None)


def _openapi(app: FastAPI) -> dict:
    """The document without FastAPI's 422: validation errors are 400 here."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in doc["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        schemas = doc.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = doc
    return app.openapi_schema


def build_app(gateway: Gateway, batch_store: BatchStore | None = None) -> FastAPI:
    """`batch_store`: where the Batch API keeps files and batches (None: no Batch API)."""
    # FastAPI itself makes the SERVER span of each request (joined to the caller's W3C
    # traceparent) with the global tracer provider; telemetry_config() leaves out health probes.
    app = FastAPI(title="Tessera gateway", version="v1",
                  description="OpenAI-compatible inference API of a Tessera InferenceService. Send "
                              "`Authorization: Bearer <key>`; every error has OpenAI's error shape.",
                  telemetry=telemetry_config())
    app.openapi = lambda: _openapi(app)
    v1 = APIRouter(route_class=authenticated_route(gateway))
    admin = APIRouter(route_class=authenticated_route(gateway, admin=True))

    def refused(request: Request, e: GatewayError, headers: dict | None = None) -> Response:
        """The error answer, the refusal counted once (the pipeline counts its own)."""
        tenant = getattr(request.state, "tenant", None)
        count_rejection(gateway.metrics, e, (tenant.name if tenant else "", ""), endpoint_label(request))
        return error_response(e, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        error = _non_text_part(exc.body)
        if error is None:
            message, param = _validation_message(exc)
            error = bad_request(message, "invalid_value", param)
        return refused(request, error)

    @app.exception_handler(GatewayError)
    async def _on_gateway_error(request: Request, exc: GatewayError):
        return refused(request, exc)

    @app.exception_handler(HTTPException)
    async def _on_http_error(request: Request, exc: HTTPException):
        # Routing's 404 and 405 (with its Allow header), and a body FastAPI could not read (400).
        detail = f"{exc.detail}: {request.method} {request.url.path}" if exc.status_code in (404, 405) \
            else str(exc.detail)
        return refused(request, http_error(exc.status_code, detail), exc.headers)

    @app.exception_handler(ClientGone)
    async def _on_client_gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(internal())

    generation_errors = error_responses(400, 401, 404, 429, 500, 503)

    @v1.post("/v1/completions", responses=generation_errors)
    async def completions(body: CompletionRequest, request: Request):
        gen = _completion_request(body)
        stream = await _open(gateway, gen, request, "completions")
        want_logprobs = body.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_completion_chunks(stream, body.model, want_logprobs, include_usage))
        return completion_json(stream, body, await _collect(stream, request))

    @v1.post("/v1/chat/completions", responses=generation_errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        # Tool settings first: every mistake in them is a 400 before any engine time.
        tools = plan_tool_calls(body.tools, body.tool_choice, body.parallel_tool_calls,
                                parser_name=gateway.config.model.tool_call_parser)
        gen = _chat_request(body, tools)
        stream = await _open(gateway, gen, request, "chat")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_chat_chunks(stream, body.model, body.logprobs, include_usage, tools))
        return chat_completion_json(stream, body, tools, await _collect(stream, request))

    @v1.get("/v1/models", responses=error_responses(401, 500))
    async def models(request: Request):
        """The base model and its LoRA adapters, those the API key may use."""
        entries = gateway.catalog.visible(request.state.tenant)
        return {"object": "list", "data": [_model_json(e, gateway.model.max_model_len) for e in entries]}

    @v1.get("/v1/models/{model_id:path}", responses=error_responses(401, 404, 500))
    async def model(model_id: str, request: Request):
        """One model, as listed; 404 for one the API key may not use."""
        return _model_json(gateway.catalog.find(model_id, request.state.tenant), gateway.model.max_model_len)

    @admin.post("/v1/load_lora_adapter", responses=admin_error_responses())
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
        """Serve a LoRA adapter under a new model name, on every engine pod (admin key only)."""
        return _admin_response(await lora_admin.load_adapter(gateway, body.lora_name, body.lora_path,
                                                             request.state.tenant.name))

    @admin.post("/v1/unload_lora_adapter", responses=admin_error_responses())
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
        """Stop serving a LoRA adapter on every engine pod (admin key only); requests in flight finish."""
        return _admin_response(await lora_admin.unload_adapter(gateway, body.lora_name, request.state.tenant.name))

    @app.get("/health", responses=error_responses(503))
    async def health():
        if gateway.pool.routable():
            return {"status": "ok", "pods": len(gateway.pool.routable())}
        return error_response(unavailable("no engine pod is serving", "no_engine_pod"))

    # Kubernetes probes. Liveness: the process answers (no pod routable is
    # no reason to restart the gateway). Readiness: it takes requests, which
    # with admission.queue_without_pods it does at zero pods (they queue:
    # the demand that scales a pool from zero).
    @app.get("/health/live")
    async def live():
        return {"status": "ok"}

    @app.get("/health/ready", responses=error_responses(503))
    async def ready():
        if gateway.ready:
            return {"status": "ok", "pods": len(gateway.pool.routable())}
        return error_response(unavailable("no engine pod is serving", "no_engine_pod"))

    app.include_router(v1)
    app.include_router(admin)
    if batch_store is not None:
        app.include_router(batch_router(gateway, batch_store))
    return app


def completion_json(stream: ResponseStream, body: CompletionRequest, choices) -> dict:
    """A non-streamed /v1/completions answer."""
    want_logprobs = body.logprobs is not None
    return {
        "id": f"cmpl-{stream.id}", "object": "text_completion", "created": stream.created, "model": body.model,
        "choices": [completion_choice(c, want_logprobs, stream.choices[c.index].text_offsets) for c in choices],
        "usage": usage_json(stream.usage),
    }


def chat_completion_json(stream: ResponseStream, body: ChatCompletionRequest, tools: ToolCallPlan | None,
                         choices) -> dict:
    """A non-streamed /v1/chat/completions answer."""
    return {
        "id": f"chatcmpl-{stream.id}", "object": "chat.completion", "created": stream.created,
        "model": body.model, "choices": [chat_choice(c, body.logprobs, new_choice_parser(tools)) for c in choices],
        "usage": usage_json(stream.usage),
    }


async def run_completion(gateway: Gateway, body: CompletionRequest, tenant: Tenant, endpoint: str) -> dict:
    """A non-streamed completion with no HTTP request around it (a batch line):
    the same pipeline and answer as the route's; raises GatewayError."""
    stream = await gateway.open_stream(_completion_request(body), tenant, endpoint)
    return completion_json(stream, body, await _collect_detached(stream))


async def run_chat_completion(gateway: Gateway, body: ChatCompletionRequest, tenant: Tenant, endpoint: str) -> dict:
    """A non-streamed chat completion with no HTTP request around it (a batch line); raises GatewayError."""
    tools = plan_tool_calls(body.tools, body.tool_choice, body.parallel_tool_calls,
                            parser_name=gateway.config.model.tool_call_parser)
    stream = await gateway.open_stream(_chat_request(body, tools), tenant, endpoint)
    return chat_completion_json(stream, body, tools, await _collect_detached(stream))


async def _collect_detached(stream: ResponseStream):
    try:
        return await stream.collect()
    except Exception as e:
        raise client_error(e, "mid-request") from None
    finally:
        await stream.aclose()


def _new_id() -> str:
    return uuid.uuid4().hex


def _completion_request(body: CompletionRequest) -> GenerationRequest:
    if body.echo:
        raise bad_request("echo: not supported", "unsupported", "echo")
    if body.suffix:
        raise bad_request("suffix: not supported", "unsupported", "suffix")
    if body.logit_bias:
        raise bad_request("logit_bias: not supported", "unsupported", "logit_bias")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of: only best_of == n is supported", "unsupported", "best_of")
    prompt, ids = _single_prompt(body.prompt)
    options = body.sampling_options(body.max_tokens, body.logprobs)
    return GenerationRequest(_new_id(), body.model, prompt=prompt, prompt_token_ids=ids, options=options,
                             priority_class=body.priority_class, user=body.user)


def _single_prompt(prompt) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if prompt and all(isinstance(p, int) for p in prompt):
        return None, list(prompt)
    if len(prompt) == 1:
        return _single_prompt(prompt[0])
    raise bad_request("prompt: give one prompt (a string or a list of token ids); batches are not supported",
                      "unsupported", "prompt")


def _chat_request(body: ChatCompletionRequest, tools: ToolCallPlan | None) -> GenerationRequest:
    if body.logit_bias:
        raise bad_request("logit_bias: not supported", "unsupported", "logit_bias")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: needs logprobs=true", "invalid_value", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    options = body.sampling_options(max_tokens, logprobs)
    constrain_to_tool_calls(options, tools)
    return GenerationRequest(_new_id(), body.model, messages=_template_messages(body.messages),
                             add_generation_prompt=body.add_generation_prompt,
                             tools=tools.template_tools if tools else None,
                             options=options, priority_class=body.priority_class, user=body.user)


def _template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them, earlier tool calls and results included."""
    return [template_message(f"messages[{i}]", m.role, m.text(), _history_calls(m), m.tool_call_id, m.name)
            for i, m in enumerate(messages)]


def _history_calls(message: ChatMessage) -> list[HistoryCall]:
    return [HistoryCall(call.id, call.function.name, call.function.arguments) for call in message.tool_calls or ()]



class ClientGone(Exception):
    """The client of a non-streamed request disconnected before the answer."""


async def _unless_disconnected(request: Request, awaitable):
    """Await, but give up (cancelling the work, which aborts the request on
    its pods) if the client disconnects first: until a response starts,
    nothing else would notice."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _open(gateway: Gateway, gen: GenerationRequest, request: Request, endpoint: str) -> ResponseStream:
    return await _unless_disconnected(request, gateway.open_stream(gen, request.state.tenant, endpoint))


async def _collect(stream: ResponseStream, request: Request):
    try:
        return await _unless_disconnected(request, stream.collect())
    except ClientGone:
        raise
    except Exception as e:
        raise client_error(e, "mid-request") from None


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for event in events:
            yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chunks(stream: ResponseStream, base: dict, include_usage: bool, render) -> AsyncIterator[dict]:
    """SSE events of a stream: the chunks of each update (`render` makes
    their choices, one chunk each), then the usage; if anything fails
    mid-way (the engine, or a bug), an error event instead (`_sse` still
    ends the stream with [DONE], so no client waits for more)."""
    try:
        async for update in stream:
            for choice in render(update):
                yield {**base, "choices": [choice], **({"usage": None} if include_usage else {})}
    except Exception as e:
        yield client_error(e, "mid-stream").to_openai()
        return
    if include_usage:
        yield {**base, "choices": [], "usage": usage_json(stream.usage)}


def _completion_chunks(stream: ResponseStream, model: str, want_logprobs: bool,
                       include_usage: bool) -> AsyncIterator[dict]:
    # Per choice: its logprob entries not sent yet, how many were, and the characters sent.
    pending: list[list[TokenLogprob]] = [[] for _ in stream.choices]
    num_sent = [0] * len(stream.choices)
    num_chars = [0] * len(stream.choices)

    def render(update):
        i = update.index
        pending[i] += update.logprobs
        num_chars[i] += len(update.text)
        offsets = stream.choices[i].text_offsets
        start = num_sent[i]
        end = start + len(pending[i])
        if update.finish_reason is None:
            # A token starting past the text sent may yet be cut off by a stop string (its offset would
            # move): its entry waits for the text. Offsets only grow, so the wait is a suffix.
            while end > start and offsets[end - 1] > num_chars[i]:
                end -= 1
        entries, pending[i] = pending[i][:end - start], pending[i][end - start:]
        num_sent[i] = end
        return [completion_choice(dataclasses.replace(update, logprobs=entries), want_logprobs, offsets[start:end])]

    base = {"id": f"cmpl-{stream.id}", "object": "text_completion", "created": stream.created, "model": model}
    return _chunks(stream, base, include_usage, render)


def _chat_chunks(stream: ResponseStream, model: str, want_logprobs: bool, include_usage: bool,
                 tools: ToolCallPlan | None) -> AsyncIterator[dict]:
    started = [False] * len(stream.choices)  # the first delta of a choice carries the role
    parsers = [new_choice_parser(tools) for _ in stream.choices]  # each choice's output is parsed on its own

    def render(update):
        first, started[update.index] = not started[update.index], True
        parser = parsers[update.index]
        if parser is None:
            return [chat_chunk_choice(update, want_logprobs, first)]
        return tool_chunk_choices(update, want_logprobs, first, parser)

    base = {"id": f"chatcmpl-{stream.id}", "object": "chat.completion.chunk", "created": stream.created,
            "model": model}
    return _chunks(stream, base, include_usage, render)
