"""Request bodies and error responses of the OpenAI-compatible REST API
(pydantic models: they validate the types and publish the OpenAPI document).

Unknown fields are refused, as OpenAI does, so a typo never silently drops a
parameter. vLLM's extra sampling fields are accepted (top_k, min_p, ...);
`priority_class` is Tessera's own. The document states the constraints the
gateway enforces (lengths, ranges, unsupported values), so what a
schema-driven client thinks valid is what the server accepts, short of the
limits only the served model knows (context length, vocabulary), which the
field descriptions name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway import structured_output
from tessera.lora import LORA_NAME_RULE, MAX_LORA_NAME_LEN
from gateway.lora_admin import MAX_LORA_PATH_LEN
from gateway.request import SamplingOptions
from gateway.tool_calls.limits import (
    MAX_DESCRIPTION_CHARS,
    MAX_MESSAGE_TOOL_CALLS,
    MAX_TOOL_CALL_ARGUMENTS_CHARS,
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOL_NAME_CHARS,
    MAX_TOOLS,
    TOOL_NAME_RULE,
)
from tessera.sampling_limits import (
    API_RANGES,
    INT32_MAX,
    MAX_COMPLETION_LOGPROBS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
)

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, description="a token id of the model's vocabulary")]
Text = Annotated[str, Field(min_length=1)]
_CONTEXT = " The prompt plus max_tokens must fit the model's context (GET /v1/models: max_model_len)."
# Accepted so SDKs that always send them work, refused (400) unless unused.
_UNSUPPORTED = "Not supported: only the value shown is accepted."


def _ranged(name: str, default=None, **kwargs) -> Field:
    """A sampling field with the public API's range (tessera.sampling_limits.API_RANGES)."""
    return Field(default, **API_RANGES[name].pydantic(), **kwargs)


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, "
                                  "rate_limit_error, service_unavailable, engine_error or internal_error")
    param: str | None = Field(description="the request field at fault, if any")
    code: str | None = Field(description="a machine-readable reason (context_length_exceeded, "
                                         "tokens_per_minute, ...)")


class ErrorResponse(BaseModel):
    """OpenAI's error object: every non-2xx answer has this shape."""

    error: ErrorDetail


_ERROR_STATUSES = {
    400: "Invalid request: malformed JSON, wrong types, out-of-range values, unknown or unsupported fields, "
         "a prompt over the context, an unknown priority class, a bad output constraint",
    401: "No API key, a malformed Authorization header or a wrong key (checked before the body)",
    403: "The API key may not call this endpoint: admin endpoints need a tenant with `admin: true` in the "
         "tenants file (always refused without a tenants file)",
    404: "An unknown model, or one the API key may not use (one answer for both)",
    429: "A tenant limit, shedding or a full queue; Retry-After says when to retry (absent: the request "
         "can never fit the limit)",
    500: "An internal error",
    503: "No engine pod serving, a queue timeout, or the engine failed; Retry-After says when to retry",
}
# The admin endpoints' statuses: the engine pods' answers mapped (gateway/lora_admin.py). A failed
# call's body also carries `pods`, each pod's result.
_ADMIN_STATUSES = {
    400: "A bad body or adapter name; an adapter a pod refused (INVALID_ARGUMENT, it names the cause), "
         "or a pod without LoRA enabled (FAILED_PRECONDITION)",
    401: _ERROR_STATUSES[401],
    403: _ERROR_STATUSES[403] + "; or a lora_path outside the pods' --lora-root folders",
    404: "Unload: no engine pod serves the adapter",
    409: "Load: the name is already served from another folder (unload it first)",
    500: _ERROR_STATUSES[500],
    502: "A pod failed otherwise, or the pods' failures disagree (see `pods`)",
    503: "No engine pod known, or a pod unavailable",
    504: "A pod did not answer within model.lora_admin_timeout_s",
}


def _doc(**schema) -> Field:
    """JSON-schema keywords for the document alone (not enforced by pydantic)."""
    return Field(json_schema_extra=schema)


def error_responses(*statuses: int) -> dict:
    """The `responses` of a route: each status it can return, with OpenAI's error schema."""
    return {s: {"model": ErrorResponse, "description": _ERROR_STATUSES[s]} for s in statuses}


def admin_error_responses() -> dict:
    """The `responses` of the admin endpoints."""
    return {s: {"model": ErrorResponse, "description": text} for s, text in _ADMIN_STATUSES.items()}


# Strict types: JSON's true is not the integer 1, nor "2" the number 2 (as
# OpenAI answers); unknown fields are refused.
_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = _STRICT

    model: str = Field(description="the served model or one of its LoRA adapters (GET /v1/models); another "
                                   "name, or one the API key may not use, is 404")
    n: int = _ranged("n", 1)
    temperature: float | None = _ranged("temperature")
    top_p: float | None = _ranged("top_p")
    presence_penalty: float | None = _ranged("presence_penalty")
    frequency_penalty: float | None = _ranged("frequency_penalty")
    seed: int | None = _ranged("seed",
                               description="choice i samples with seed + i, wrapped to a signed 64-bit integer")
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    # vLLM's extensions.
    top_k: int | None = _ranged("top_k")
    min_p: float | None = _ranged("min_p")
    repetition_penalty: float | None = _ranged("repetition_penalty")
    min_tokens: int = _ranged("min_tokens", 0, description="at most max_tokens (or what the context leaves)")
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    # Tessera: a priority class the API key may use (default: the key's).
    priority_class: str | None = Field(None, max_length=64,
                                       description="a configured class the API key may use; another is 400")
    # Guided decoding (gateway/structured_output.py checks them): OpenAI's
    # response_format, vLLM's structured_outputs and older guided_* fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_options(self, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        constraint, constraint_param = structured_output.from_rest_body(self)
        return SamplingOptions(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            n=self.n,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=constraint,
            structured_outputs_param=constraint_param,
        )


_OneText = Annotated[str, _doc(minLength=1)]
_OneIds = Annotated[list[TokenId], _doc(minItems=1)]


class CompletionRequest(_SamplingFields):
    # One prompt: text, or token ids (a one-element list of either is accepted).
    # The constraints are the document's only: the gateway's own checks
    # refuse an empty prompt or a batch with a clearer message than a union's.
    prompt: _OneText | _OneIds | Annotated[list[_OneText], _doc(minItems=1, maxItems=1)] \
        | Annotated[list[_OneIds], _doc(minItems=1, maxItems=1)] = Field(
            description="one prompt: text, or token ids; batches of prompts are not supported." + _CONTEXT)
    max_tokens: int | None = _ranged("max_tokens", 16, description="output tokens per choice." + _CONTEXT)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = Field(False, description=_UNSUPPORTED, json_schema_extra={"enum": [False]})
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only best_of == n is supported")
    suffix: str | None = Field(None, description=_UNSUPPORTED, json_schema_extra={"maxLength": 0})
    logit_bias: dict[str, float] | None = Field(None, description=_UNSUPPORTED,
                                                json_schema_extra={"maxProperties": 0})


_FUNCTION_NAME_DOC = {"type": "string", "pattern": f"^{TOOL_NAME_RULE.pattern}$"}
_TOOL_DOC = {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": _FUNCTION_NAME_DOC,
                           "description": {"type": "string", "maxLength": MAX_DESCRIPTION_CHARS},
                           "parameters": {"type": "object", "description": "a JSON Schema of the arguments "
                                                                           "object (its type: object)"},
                           "strict": {"type": "boolean"}},
        },
    },
}
_TOOLS_DOC = {"type": "array", "minItems": 1, "maxItems": MAX_TOOLS, "items": _TOOL_DOC}
_NAMED_CHOICE_DOC = {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {"type": {"type": "string", "enum": ["function"]},
                   "function": {"type": "object", "required": ["name"], "additionalProperties": False,
                                "properties": {"name": _FUNCTION_NAME_DOC}}},
}


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    arguments: str = Field(max_length=MAX_TOOL_CALL_ARGUMENTS_CHARS,
                           description="the arguments object's JSON text, as the model wrote it")


class MessageToolCall(BaseModel):
    """A call an earlier assistant message made (a choice's `message.tool_calls[i]`, sent back)."""

    model_config = _STRICT
    id: str = Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="null: no text (an assistant message "
                                                                   "that only calls tools)")
    name: str | None = Field(None, max_length=256)
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_MESSAGE_TOOL_CALLS,
                                                     description="assistant messages only")
    tool_call_id: str | None = Field(None, min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS,
                                     description="tool messages only, and required there: the call answered")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="rendered with the model's chat template." + _CONTEXT)
    max_tokens: int | None = _ranged("max_tokens", description="absent: what the context leaves")
    max_completion_tokens: int | None = _ranged("max_tokens", description="max_tokens' newer name")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")
    add_generation_prompt: bool = True
    logit_bias: dict[str, float] | None = Field(None, description=_UNSUPPORTED,
                                                json_schema_extra={"maxProperties": 0})
    # Tool calling (gateway/tool_calls checks them, each mistake a 400 naming
    # the field, e.g. tools[2].function.parameters); the document states
    # their shape, the checks' one home is gateway/tool_calls/definitions.py.
    tools: list[dict] | None = Field(None, description="functions the model may call (docs/tool-calling.md)",
                                     json_schema_extra={"anyOf": [_TOOLS_DOC, {"type": "null"}]})
    tool_choice: Any = Field(None, description="none, auto (the default with tools: needs the model's "
                                               "tool_call_parser), required, or a named function",
                             json_schema_extra={"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                                          _NAMED_CHOICE_DOC, {"type": "null"}]})
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true)")


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter."""

    model_config = _STRICT
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_LEN,
                           description=f"the model name clients will use ({LORA_NAME_RULE}; not the base model's)")
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH_LEN,
                           description="the adapter's folder (PEFT layout) on the engine pods, inside their "
                                       "--lora-root folders")


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter."""

    model_config = _STRICT
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_LEN)
