"""Errors a client sees, with their HTTP status and gRPC code in one place.

REST renders them in OpenAI's error JSON; gRPC aborts with the code and the
message. Every failure the gateway can predict becomes one of these; an
unexpected exception becomes a 500 / INTERNAL with no internals leaked.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


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

    def __str__(self) -> str:
        return self.message

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, code: str | None = None, param: str | None = None) -> GatewayError:
    return GatewayError(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", message, code, param)


def unauthenticated(message: str) -> GatewayError:
    return GatewayError(401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error", message, "invalid_api_key")


def model_not_found(model: str, served: str) -> GatewayError:
    return GatewayError(404, grpc.StatusCode.NOT_FOUND, "invalid_request_error",
                        f"The model `{model}` does not exist; this gateway serves `{served}`.", "model_not_found",
                        "model")


def rate_limited(message: str, code: str, retry_after: float | None) -> GatewayError:
    return GatewayError(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error", message, code,
                        retry_after=retry_after)


def unavailable(message: str, code: str = "service_unavailable", retry_after: float | None = 1.0) -> GatewayError:
    return GatewayError(503, grpc.StatusCode.UNAVAILABLE, "service_unavailable", message, code,
                        retry_after=retry_after)


def internal(message: str = "internal error") -> GatewayError:
    return GatewayError(500, grpc.StatusCode.INTERNAL, "internal_error", message, "internal_error")


class StreamBroken(Exception):
    """The engine failed after tokens were already sent: the stream ends with this."""
