"""The public gRPC service tessera.v1.Inference over the serving pipeline.

Every call ends with a status: the key is checked before the message, a
refusal aborts with its code (and `retry-after` trailing metadata), and a
failure mid-call (the engine, or a bug) aborts with UNAVAILABLE or INTERNAL.
"""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from gateway.errors import GatewayError, bad_request, client_error
from gateway.rejections import count_rejection
from gateway.request import ChoiceUpdate, GenerationRequest, SamplingOptions, Usage
from gateway.response_stream import ResponseStream
from gateway.serving import Gateway
from gateway.structured_output import checked, constrain_to_tool_calls
from gateway.tool_calls import (
    ParsedOutput,
    StreamDelta,
    ToolCallParser,
    ToolCallPlan,
    finish_reason,
    new_choice_parser,
    plan_tool_calls,
)
from gateway.tool_calls.history import HistoryCall, template_message
from tessera.structured_output import params_from_proto
from tessera.tracing import end_rpc_span, parent_context, server_call_code, start_rpc_span, tracer
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc

_tracer = tracer("tessera.gateway")
SERVICE = pb.DESCRIPTOR.services_by_name["Inference"]


class Undecodable:
    """What a method receives for bytes that are not its request message."""

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error


def _parser(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return Undecodable(message_class.DESCRIPTOR.full_name, str(e))
    return parse


def add_to_server(service: InferenceService, server) -> None:
    """tessera.v1.Inference on `server`, registered as the generated
    add_InferenceServicer_to_server does, except that bytes which are not the
    method's message reach the method (INVALID_ARGUMENT, after the key) rather
    than grpc's own UNKNOWN."""
    handlers = {}
    for method in SERVICE.methods:
        request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(service, method.name), request_deserializer=_parser(request),
                                     response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _decoded(msg):
    if isinstance(msg, Undecodable):
        raise bad_request(f"the message is not a {msg.type_name}: {msg.error}", "invalid_message")
    return msg


def _options(p: pb.GenerationParams) -> SamplingOptions:
    def get(name, default):
        return getattr(p, name) if p.HasField(name) else default

    constraint = None
    if p.HasField("structured_outputs"):
        constraint = checked(lambda: params_from_proto(p.structured_outputs), "params.structured_outputs")

    return SamplingOptions(
        max_tokens=get("max_tokens", None), temperature=get("temperature", 1.0), top_p=get("top_p", 1.0),
        top_k=get("top_k", 0), min_p=get("min_p", 0.0), seed=get("seed", None),
        presence_penalty=get("presence_penalty", 0.0), frequency_penalty=get("frequency_penalty", 0.0),
        repetition_penalty=get("repetition_penalty", 1.0), n=get("n", 1), stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, min_tokens=get("min_tokens", 0),
        logprobs=get("logprobs", None), structured_outputs=constraint,
        structured_outputs_param="params.structured_outputs" if constraint is not None else None,
    )


def _completion_request(msg: pb.CompletionRequest) -> tuple[GenerationRequest, None]:
    """The request (and, as for chat, its tool plan: never any)."""
    if msg.prompt and msg.prompt_token_ids:
        raise bad_request("give prompt or prompt_token_ids, not both", "invalid_value", "prompt")
    return GenerationRequest(
        uuid.uuid4().hex, msg.model, prompt=msg.prompt if not msg.prompt_token_ids else None,
        prompt_token_ids=list(msg.prompt_token_ids) or None, options=_options(msg.params),
        priority_class=msg.priority_class or None, user=msg.user or None,
    ), None


def _chat_request(msg: pb.ChatRequest, parser_name: str | None) -> tuple[GenerationRequest, ToolCallPlan | None]:
    """The request and its tool plan; `parser_name`: the model's tool-call parser."""
    if not msg.messages:
        raise bad_request("messages: at least one message is required", "invalid_value", "messages")
    roles = {"system", "developer", "user", "assistant", "tool"}
    for i, m in enumerate(msg.messages):
        if m.role not in roles:
            raise bad_request(f"messages[{i}].role: {m.role!r} is not one of {sorted(roles)}", "invalid_value",
                              "messages")
    tools = plan_tool_calls(_tools(msg), _tool_choice(msg),
                            msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else None, parser_name)
    options = _options(msg.params)
    constrain_to_tool_calls(options, tools)
    messages = [template_message(f"messages[{i}]", m.role, m.content,
                                 [HistoryCall(c.id, c.name, c.arguments) for c in m.tool_calls],
                                 m.tool_call_id or None, m.name or None) for i, m in enumerate(msg.messages)]
    return GenerationRequest(
        uuid.uuid4().hex, msg.model, messages=messages,
        add_generation_prompt=msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True,
        tools=tools.template_tools if tools else None,
        options=options, priority_class=msg.priority_class or None, user=msg.user or None,
    ), tools


def _tools(msg: pb.ChatRequest) -> list[dict[str, Any]] | None:
    """The tools as REST's JSON (gateway/tool_calls checks them, naming REST's fields)."""
    if not msg.tools:
        return None
    return [{"type": "function", "function": _function(tool, i)} for i, tool in enumerate(msg.tools)]


def _function(tool: pb.FunctionTool, index: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.HasField("description"):
        function["description"] = tool.description
    if tool.HasField("strict"):
        function["strict"] = tool.strict
    if tool.parameters_json:
        try:
            function["parameters"] = json.loads(tool.parameters_json)
        except (ValueError, RecursionError):
            where = f"tools[{index}].parameters_json"
            raise bad_request(f"{where}: not valid JSON", "invalid_function_parameters", where) from None
    return function


def _tool_choice(msg: pb.ChatRequest) -> str | dict[str, Any] | None:
    kind = msg.tool_choice.WhichOneof("choice") if msg.HasField("tool_choice") else None
    if kind == "function":
        return {"type": "function", "function": {"name": msg.tool_choice.function}}
    return msg.tool_choice.mode if kind == "mode" else None


def _delta(update: ChoiceUpdate) -> pb.ChoiceDelta:
    return pb.ChoiceDelta(
        index=update.index, text=update.text, token_ids=update.token_ids,
        logprobs=[_token_info(e) for e in update.logprobs], finish_reason=update.finish_reason or "",
        stop_reason="" if update.stop_reason is None else str(update.stop_reason),
    )


def _tool_deltas(update: ChoiceUpdate, parser: ToolCallParser) -> list[pb.ChoiceDelta]:
    """An update read by the choice's tool-call parser: what its text adds
    (with its tokens), and at the choice's end what the parser held back,
    with the finish reason (REST's chunks, gateway/openai_api/render.py)."""
    added = parser.feed(update.text)
    deltas = [pb.ChoiceDelta(index=update.index, text=added.content, tool_calls=_call_deltas(added),
                             token_ids=update.token_ids, logprobs=[_token_info(e) for e in update.logprobs])]
    if update.finish_reason is not None:
        last = parser.finish()
        deltas.append(pb.ChoiceDelta(
            index=update.index, text=last.content, tool_calls=_call_deltas(last),
            finish_reason=finish_reason(update.finish_reason, parser.result()),
            stop_reason="" if update.stop_reason is None else str(update.stop_reason)))
    return deltas


def _call_deltas(delta: StreamDelta) -> list[pb.ToolCallDelta]:
    return [pb.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "", arguments=d.arguments)
            for d in delta.tool_calls]


def _choice(c: ChoiceUpdate, parser: ToolCallParser | None) -> pb.Choice:
    """A whole choice; with a tool-call parser, its text is the content and its calls come apart."""
    output = parser.parse(c.text) if parser is not None else None
    return pb.Choice(index=c.index, text=c.text if output is None else output.content or "",
                     tool_calls=_calls(output), token_ids=c.token_ids,
                     logprobs=[_token_info(e) for e in c.logprobs],
                     finish_reason=_finish_reason(c.finish_reason, output),
                     stop_reason="" if c.stop_reason is None else str(c.stop_reason))


def _calls(output: ParsedOutput | None) -> list[pb.ToolCall]:
    calls = output.tool_calls if output is not None else ()
    return [pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments_json) for call in calls]


def _finish_reason(engine_reason: str | None, output: ParsedOutput | None) -> str:
    if engine_reason is None:
        return ""
    return engine_reason if output is None else finish_reason(engine_reason, output)



def _token_info(e) -> pb.TokenInfo:
    return pb.TokenInfo(token_id=e.token_id, token=e.token, logprob=e.logprob,
                        top_logprobs=[pb.TopLogprob(token_id=t, token=s, logprob=lp) for t, s, lp in e.top])


def _usage(u: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    total_tokens=u.total_tokens, cached_tokens=u.cached_tokens)


def _authorization(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return None


@contextlib.contextmanager
def _server_span(context, method: str) -> Iterator[None]:
    """The call's SERVER span, current inside (the pipeline's spans are its
    children), joined to the caller's W3C context; it ends with the call's
    status code."""
    span = start_rpc_span(_tracer, f"{SERVICE.full_name}/{method}", SpanKind.SERVER,
                          parent_context(context.invocation_metadata()))
    error = None
    try:
        with trace.use_span(span, record_exception=False, set_status_on_exception=False):
            yield
    except BaseException as e:  # an abort, the caller gone, a bug: each gets its code
        error = e
        raise
    finally:
        end_rpc_span(span, server_call_code(context, error), context.details() or "")


async def _abort(context, e: GatewayError):
    """End the call with the error's code (raises, as context.abort does)."""
    if e.retry_after is not None:
        context.set_trailing_metadata((("retry-after", str(e.retry_after_s)),))
    await context.abort(e.grpc_code, e.message)


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def _open(self, build, msg, context, endpoint: str) -> tuple[ResponseStream, ToolCallPlan | None]:
        """The request's stream and tool plan, or the call aborted. The key
        is checked before the message is (401 before 400, as on REST)."""
        tenant = None
        try:
            tenant = self.gateway.authenticate(_authorization(context), endpoint)
            request, tools = build(_decoded(msg))
            return await self.gateway.open_stream(request, tenant, endpoint), tools
        except Exception as e:  # not the abort below: it is raised outside this `try`
            error = client_error(e, "before the first token")
        # What the pipeline did not count (a message that does not parse, a bad field): once, here.
        count_rejection(self.gateway.metrics, error, (tenant.name if tenant else "", ""), endpoint)
        await _abort(context, error)

    async def _stream(self, build, msg, context, endpoint: str):
        with _server_span(context, endpoint):
            stream, tools = await self._open(build, msg, context, endpoint)
            parsers = [new_choice_parser(tools) for _ in stream.choices]  # each choice's output is parsed on its own
            error = None
            try:
                async for update in stream:
                    parser = parsers[update.index]
                    for delta in [_delta(update)] if parser is None else _tool_deltas(update, parser):
                        yield pb.CompletionChunk(id=stream.id, model=msg.model, choices=[delta])
            except Exception as e:
                error = client_error(e, "mid-stream")
            if error is not None:
                await _abort(context, error)
            yield pb.CompletionChunk(id=stream.id, model=msg.model, usage=_usage(stream.usage))

    async def _unary(self, build, msg, context, endpoint: str) -> pb.CompletionResult:
        with _server_span(context, endpoint):
            stream, tools = await self._open(build, msg, context, endpoint)
            try:
                choices = await stream.collect()
            except Exception as e:
                error = client_error(e, "mid-request")
            else:
                error = None
            if error is not None:
                await _abort(context, error)
            return pb.CompletionResult(
                id=stream.id, model=msg.model, created=stream.created, usage=_usage(stream.usage),
                choices=[_choice(c, new_choice_parser(tools)) for c in choices],
            )

    async def Complete(self, request, context):
        async for chunk in self._stream(_completion_request, request, context, "Complete"):
            yield chunk

    async def CompleteUnary(self, request, context):
        return await self._unary(_completion_request, request, context, "CompleteUnary")

    def _chat_request(self):
        return functools.partial(_chat_request, parser_name=self.gateway.config.model.tool_call_parser)

    async def Chat(self, request, context):
        async for chunk in self._stream(self._chat_request(), request, context, "Chat"):
            yield chunk

    async def ChatUnary(self, request, context):
        return await self._unary(self._chat_request(), request, context, "ChatUnary")

    async def ListModels(self, request, context):
        with _server_span(context, "ListModels"):
            try:
                tenant = self.gateway.authenticate(_authorization(context), "ListModels")
                _decoded(request)
            except GatewayError as e:
                count_rejection(self.gateway.metrics, e, ("", ""), "ListModels")
                await _abort(context, e)
            # The base model and its LoRA adapters the key may use, as REST's /v1/models lists them
            # (ModelInfo has no `parent` field: the base model comes first).
            max_len = self.gateway.model.max_model_len
            return pb.ListModelsResponse(models=[pb.ModelInfo(id=e.id, max_model_len=max_len, owned_by="tessera")
                                                 for e in self.gateway.catalog.visible(tenant)])
