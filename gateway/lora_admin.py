"""The admin endpoints' work: load or unload a LoRA adapter on every engine pod.

`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's
names and bodies) reach here once the caller's key is an admin's
(gateway/tenants.py). The call goes to every pod this gateway knows, all
at once, each with `model.lora_admin_timeout_s` to answer; nothing waits
longer. Each pod's answer is kept (`PodOutcome`) and returned to the
caller, so a partial result is plain to see:

- every pod succeeded: 200;
- otherwise the failures' HTTP status when they agree (the pods'
  gRPC codes mapped by `_HTTP_OF`), else 502, with every pod's result.

The gateway's own list follows the pods at once: a load that succeeded on
some pod adds the name (requests on it go to those pods: gateway/router.py),
an unload removes it, and each answering pod's adapter list replaces what
its last report said, before its next report comes. An unload that a pod
answers NOT_FOUND is fine for that pod (it did not serve the adapter), unless
every pod answers so: then nobody served it, 404.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from gateway.config import lora_name_problem
from gateway.errors import GatewayError, bad_request, unavailable
from gateway.pods import Pod
from tessera.v1 import engine_pb2 as epb

if TYPE_CHECKING:
    from gateway.serving import Gateway

logger = logging.getLogger(__name__)

# A pod's gRPC answer -> (HTTP status, the error's code) for the caller.
_HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_lora_adapter"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "lora_not_enabled"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "lora_path_not_allowed"),
    grpc.StatusCode.NOT_FOUND: (404, "lora_adapter_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "lora_adapter_exists"),
    grpc.StatusCode.UNAVAILABLE: (503, "engine_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "engine_timeout"),
}
# Anything else (INTERNAL, UNIMPLEMENTED from a pod without the RPC, ...): the pod failed.
_OTHER = (502, "engine_error")
# Failures that disagree with each other: no single status tells the story.
_MIXED = (502, "lora_admin_partial")
_ERROR_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error",
                409: "invalid_request_error"}
# A pod's message is shown to the admin; bounded so a verbose pod cannot bloat the answer.
_MAX_POD_MESSAGE = 512
MAX_LORA_PATH_LEN = 4096


@dataclass(frozen=True)
class PodOutcome:
    """One pod's answer to a load or unload."""

    address: str
    role: str
    status: int
    """200, or the HTTP status its gRPC code maps to."""
    grpc_code: str
    """The gRPC status name (OK on success)."""
    message: str = ""
    """The pod's message on failure (it names the cause)."""

    @property
    def ok(self) -> bool:
        return self.status == 200

    def to_json(self) -> dict:
        return {"pod": self.address, "role": self.role, "ok": self.ok, "status": self.status,
                "grpc_code": self.grpc_code, "message": self.message}


@dataclass(frozen=True)
class AdminResult:
    """Every pod's outcome of one admin call, and the answer they add up to."""

    action: str
    """"load" or "unload"."""
    lora_name: str
    outcomes: tuple[PodOutcome, ...]

    @property
    def ok(self) -> bool:
        return bool(self.outcomes) and all(o.ok for o in self.outcomes)

    def error(self) -> GatewayError:
        """The caller's non-2xx answer when some pod failed."""
        failed = [o for o in self.outcomes if not o.ok]
        status, code = _status_of(failed[0]) if len({o.status for o in failed}) == 1 else _MIXED
        done = len(self.outcomes) - len(failed)
        first = failed[0]
        message = (f"{self.action} of LoRA adapter {self.lora_name!r} failed on {len(failed)} of "
                   f"{len(self.outcomes)} engine pod(s) (succeeded on {done}); {first.address}: "
                   f"{first.grpc_code}: {first.message}")
        kind = _ERROR_TYPES.get(status, "service_unavailable" if status in (503, 504) else "engine_error")
        return GatewayError(status, _grpc_code(status), kind, message, code, "lora_name" if status == 404 else None)

    def to_json(self) -> dict:
        """The success body (vLLM answers a line of text; this says which pods did it)."""
        verb = "added" if self.action == "load" else "removed"
        return {"object": "lora_adapter", "lora_name": self.lora_name, "action": self.action,
                "message": f"Success: LoRA adapter '{self.lora_name}' {verb} successfully.",
                "pods": [o.to_json() for o in self.outcomes]}


def _status_of(outcome: PodOutcome) -> tuple[int, str]:
    code = getattr(grpc.StatusCode, outcome.grpc_code, None)
    return _HTTP_OF.get(code, _OTHER)


def _grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP status (GatewayError carries both)."""
    for code, (http, _) in _HTTP_OF.items():
        if http == status:
            return code
    return grpc.StatusCode.UNKNOWN


def check_lora_name(name: str, base: str) -> None:
    problem = lora_name_problem(name, base)
    if problem is not None:
        raise bad_request(f"lora_name: {problem}", "invalid_value", "lora_name")


def check_lora_path(path: str) -> None:
    if not path or len(path) > MAX_LORA_PATH_LEN or "\0" in path:
        raise bad_request(f"lora_path: the adapter's folder on the engine pods (1-{MAX_LORA_PATH_LEN} "
                          "characters, no NUL)", "invalid_value", "lora_path")


async def load_adapter(gateway: Gateway, lora_name: str, lora_path: str, who: str) -> AdminResult:
    """LoadLoRAAdapter on every pod; the gateway's list gains the name if any pod took it."""
    check_lora_name(lora_name, gateway.catalog.base)
    check_lora_path(lora_path)
    request = epb.LoadLoRAAdapterRequest(lora_name=lora_name, lora_path=lora_path)
    result = await _fan_out(gateway, "load", lora_name, lambda pod, t: pod.stub.LoadLoRAAdapter(request, timeout=t))
    if any(o.ok for o in result.outcomes):
        gateway.catalog.added(lora_name)
    _log(result, who, lora_path)
    return result


async def unload_adapter(gateway: Gateway, lora_name: str, who: str) -> AdminResult:
    """UnloadLoRAAdapter on every pod; the gateway's list loses the name."""
    check_lora_name(lora_name, gateway.catalog.base)
    request = epb.UnloadLoRAAdapterRequest(lora_name=lora_name)
    result = await _fan_out(gateway, "unload", lora_name,
                            lambda pod, t: pod.stub.UnloadLoRAAdapter(request, timeout=t))
    result = _absent_is_unloaded(result)
    if any(o.ok for o in result.outcomes):
        gateway.catalog.removed(lora_name)
    _log(result, who, None)
    return result


def _absent_is_unloaded(result: AdminResult) -> AdminResult:
    """A pod's NOT_FOUND means it did not serve the adapter: unloaded there
    too, unless no pod served it at all (then the NOT_FOUNDs stand: 404)."""
    absent = [o for o in result.outcomes if o.grpc_code == "NOT_FOUND"]
    if not absent or len(absent) == len(result.outcomes):
        return result
    outcomes = tuple(PodOutcome(o.address, o.role, 200, o.grpc_code, "not served there: nothing to unload")
                     if o.grpc_code == "NOT_FOUND" else o for o in result.outcomes)
    return AdminResult(result.action, result.lora_name, outcomes)


async def _fan_out(gateway: Gateway, action: str, lora_name: str, call) -> AdminResult:
    pods = list(gateway.pool.pods.values())
    if not pods:
        raise unavailable("no engine pod is known to this gateway; retry when the pods are up", "no_engine_pod")
    timeout = gateway.config.model.lora_admin_timeout_s
    outcomes = await asyncio.gather(*(_one(pod, call, timeout) for pod in pods))
    return AdminResult(action, lora_name, tuple(outcomes))


async def _one(pod: Pod, call, timeout: float) -> PodOutcome:
    """One pod's call; its answer (the adapters it now serves) replaces
    what its last report said, so routing follows at once."""
    try:
        # The gRPC deadline ends the call; wait_for is the backstop for a channel that never connects.
        answer = await asyncio.wait_for(call(pod, timeout), timeout + 1.0)
    except grpc.aio.AioRpcError as e:
        status, _ = _HTTP_OF.get(e.code(), _OTHER)
        return PodOutcome(pod.address, pod.role, status, e.code().name, (e.details() or "")[:_MAX_POD_MESSAGE])
    except TimeoutError:
        return PodOutcome(pod.address, pod.role, 504, "DEADLINE_EXCEEDED", "no answer in time")
    except Exception as e:  # a channel closing as the pod leaves the pool, say: that pod failed, not the call
        return PodOutcome(pod.address, pod.role, _OTHER[0], "UNKNOWN", type(e).__name__)
    pod.set_adapters(answer.adapters)
    return PodOutcome(pod.address, pod.role, 200, "OK")


def _log(result: AdminResult, who: str, lora_path: str | None) -> None:
    """Who did what, and each pod's outcome (never a key: `who` is the tenant's name)."""
    where = f" from {lora_path!r}" if lora_path is not None else ""
    pods = ", ".join(f"{o.address}={o.grpc_code}" for o in result.outcomes)
    log = logger.info if result.ok else logger.warning
    log("admin %s: %s LoRA adapter %r%s: %s", who, result.action, result.lora_name, where, pods)
