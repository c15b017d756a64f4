"""Who may call an engine pod (engine_pod/server/auth.py): every
tessera.v1.Engine method and server reflection demand the deployment's
internal token, health stays open for kubelet probes; no secret, no pod
(unless --no-internal-auth); a taken port is refused, not shared."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine_pod.server.process import EnginePodProcess
from tessera.internal_secret import SECRET_ENV, SECRET_FILE_ENV, InternalSecret
from tessera.v1 import engine_pb2 as pb
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.conftest import TEST_INTERNAL_SECRET
from tests.engine_pod.server.client import greedy
from tests.engine_pod.server.conftest import POD_ARGS

SECRET = InternalSecret.from_text(TEST_INTERNAL_SECRET)
WRONG = InternalSecret.from_text("another-deployment-s-secret-0123456789abcdef")
NO_SECRET_ENV = {SECRET_ENV: "", SECRET_FILE_ENV: ""}  # a child of these tests inherits the test secret otherwise

CREDENTIALS = {
    "none": (),
    "wrong-token": WRONG.metadata(),
    "no-bearer-scheme": (("authorization", SECRET.token),),
    "empty": (("authorization", "Bearer "),),
}


def _calls(channel: grpc.Channel) -> dict:
    """Each method of the pod but health, called with the given metadata."""
    engine = pb_grpc.EngineStub(channel)
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    return {
        "Generate": lambda md: list(engine.Generate(greedy([5] * 8, 2), metadata=md, timeout=10)),
        "Abort": lambda md: engine.Abort(pb.AbortRequest(request_ids=["nope"]), metadata=md, timeout=10),
        "GetLoad": lambda md: engine.GetLoad(pb.LoadRequest(block_hashes=[b"x" * 32]), metadata=md, timeout=10),
        "StreamLoad": lambda md: next(iter(engine.StreamLoad(pb.LoadRequest(interval_ms=50), metadata=md,
                                                             timeout=10))),
        "reflection": lambda md: list(reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=md, timeout=10)),
    }


@pytest.mark.parametrize("credential", sorted(CREDENTIALS))
def test_every_method_refuses_a_caller_without_the_token(pod, credential):
    with grpc.insecure_channel(pod.address) as channel:
        for name, call in _calls(channel).items():
            with pytest.raises(grpc.RpcError) as err:
                call(CREDENTIALS[credential])
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            details = err.value.details()
            assert "internal" in details and SECRET.token not in details and TEST_INTERNAL_SECRET not in details
        # Health stays open: kubelet's gRPC probes send no credentials.
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_every_method_serves_a_caller_with_the_token(pod):
    """The same calls, authenticated: the refusals above are about the credential alone."""
    with grpc.insecure_channel(pod.address) as channel:
        calls = _calls(channel)
        tokens = [t for r in calls["Generate"](SECRET.metadata()) for t in r.token_ids]
        assert len(tokens) == 2
        assert list(calls["Abort"](SECRET.metadata()).aborted) == []
        assert calls["GetLoad"](SECRET.metadata()).serving
        assert calls["StreamLoad"](SECRET.metadata()).serving
        services = calls["reflection"](SECRET.metadata())[0].list_services_response.service
        assert "tessera.v1.Engine" in {s.name for s in services}


def _exit_log(pod: EnginePodProcess, timeout: float = 30.0) -> tuple[int, str]:
    code = pod.proc.wait(timeout)
    return code, pod.log_path.read_text()


def test_engine_without_a_secret_refuses_to_start(tiny_llama, tmp_path):
    with EnginePodProcess(tiny_llama, POD_ARGS, env=NO_SECRET_ENV, log_path=tmp_path / "pod.log") as pod:
        code, log = _exit_log(pod)
    assert code == 2, log
    assert SECRET_FILE_ENV in log and SECRET_ENV in log and "--no-internal-auth" in log


def test_no_internal_auth_serves_anyone_and_says_so(tiny_llama, tmp_path):
    with EnginePodProcess(tiny_llama, [*POD_ARGS, "--no-internal-auth"], env=NO_SECRET_ENV,
                          log_path=tmp_path / "pod.log") as pod:
        pod.wait_serving()
        with grpc.insecure_channel(pod.address) as channel:
            assert pb_grpc.EngineStub(channel).GetLoad(pb.LoadRequest(), timeout=10).serving
        log = pod.log_path.read_text()
    assert "WARNING" in log and "--no-internal-auth" in log and "auth=off" in log


def test_a_taken_port_is_refused_not_shared(pod, tiny_llama, tmp_path):
    """gRPC's SO_REUSEPORT would let a second engine share the port (and
    half the calls); it must fail, naming the port."""
    with EnginePodProcess(tiny_llama, POD_ARGS, log_path=tmp_path / "second.log", grpc_port=pod.grpc_port) as second:
        code, log = _exit_log(second)
    assert code == 2, log
    assert f"--grpc-port: cannot listen on {pod.address}" in log and "taken" in log
    assert pod.health() == health_pb2.HealthCheckResponse.SERVING
