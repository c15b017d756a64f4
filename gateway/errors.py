"""Errors a client sees, with their HTTP status and gRPC code in one place.

REST renders them in OpenAI's error JSON; gRPC aborts with the code and the
message. Every failure the gateway can predict becomes one of these; an
unexpected exception becomes a 500 / INTERNAL with no internals leaked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from math import ceil

import grpc

logger = logging.getLogger(__name__)


@dataclass
class GatewayError(Exception):
    status: int
    grpc_code: grpc.StatusCode
    type: str
    message: str
    code: str | None = None
    param: str | None = None
    # Seconds, for Retry-After (REST) and `retry-after` trailing metadata (gRPC).
    retry_after: float | None = None
    # Set once the refusal is in the metrics (gateway/rejections.py): whoever sees it next
    # (the pipeline, then the front end) counts it only if not.
    counted: bool = field(default=False, repr=False, compare=False)

    def __str__(self) -> str:
        return self.message

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def retry_after_s(self) -> int | None:
        """Whole seconds for REST's Retry-After and gRPC's `retry-after`:
        rounded up (at least 1), so a client that waits that long is not
        refused again for the same limit."""
        return None if self.retry_after is None else max(1, ceil(self.retry_after))


def bad_request(message: str, code: str | None = None, param: str | None = None) -> GatewayError:
    return GatewayError(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", message, code, param)


@dataclass
class EngineRefused(GatewayError):
    """An engine pod refused the request itself (INVALID_ARGUMENT and kin, at
    submit): a 400; `details` is the pod's own message, naming the engine's
    field, which the pipeline renames to the client's where it can."""

    details: str = ""


def engine_refused(details: str) -> EngineRefused:
    return EngineRefused(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error",
                         f"engine rejected the request: {details}", "invalid_request", details=details)


def unauthenticated(message: str) -> GatewayError:
    return GatewayError(401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error", message, "invalid_api_key")


def model_not_found(model: str) -> GatewayError:
    """An unknown model, or one the tenant may not use: one answer for both
    (OpenAI's wording), so a tenant cannot probe which adapters exist."""
    return GatewayError(404, grpc.StatusCode.NOT_FOUND, "invalid_request_error",
                        f"The model `{model[:256]}` does not exist or you do not have access to it.",
                        "model_not_found", "model")


def permission_denied(message: str) -> GatewayError:
    """An authenticated caller may not do this (an admin endpoint without an admin key)."""
    return GatewayError(403, grpc.StatusCode.PERMISSION_DENIED, "permission_error", message, "permission_denied")


def rate_limited(message: str, code: str, retry_after: float | None) -> GatewayError:
    return GatewayError(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error", message, code,
                        retry_after=retry_after)


def unavailable(message: str, code: str = "service_unavailable", retry_after: float | None = 1.0) -> GatewayError:
    return GatewayError(503, grpc.StatusCode.UNAVAILABLE, "service_unavailable", message, code,
                        retry_after=retry_after)


def internal(message: str = "internal error") -> GatewayError:
    return GatewayError(500, grpc.StatusCode.INTERNAL, "internal_error", message, "internal_error")


def http_error(status: int, message: str) -> GatewayError:
    """REST only: a route or method the API does not have (404, 405), a body
    that could not be read (400)."""
    codes = {404: "not_found", 405: "method_not_allowed"}
    return GatewayError(status, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", message,
                        codes.get(status, "invalid_request"))


class StreamBroken(Exception):
    """The engine failed after tokens were already sent: the stream ends with this."""


def client_error(e: BaseException, when: str) -> GatewayError:
    """What the client is told when a request fails `when` ("mid-stream",
    "mid-request"): a GatewayError as is, a broken engine stream as 503, and
    anything else (a bug) as 500 without internals. Only the last is logged
    here: the pipeline logs the failures it turns into GatewayErrors itself,
    so each failure is logged once."""
    if isinstance(e, GatewayError):
        return e
    if isinstance(e, StreamBroken):
        # Mid-stream the answer is an error event (or a status after chunks): no Retry-After to give.
        retry_after = None if when == "mid-stream" else 1.0
        return unavailable(f"the engine pod failed {when}: {e}", "engine_failed", retry_after)
    logger.error("request failed %s", when, exc_info=e)
    return internal(f"internal error: {type(e).__name__}")
