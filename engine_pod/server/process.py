"""Start an engine pod (`tessera engine`) as a child process and wait until it serves.

Only the health service answers without credentials; callers of the engine
itself dial with tessera/internal_channel.py. The child inherits this
process's environment, the internal secret with it."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tessera.child_process import ChildProcess, free_port, free_port_range

__all__ = ["EnginePodProcess", "SimulatedPodsProcess", "free_port", "health_status"]


def health_status(address: str, timeout: float = 1.0) -> int | None:
    """An engine pod's gRPC health status, or None if it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
    return resp.status


class EnginePodProcess(ChildProcess):
    def __init__(self, model: str | Path, extra_args: list[str] = (), env: dict | None = None,
                 log_path: str | Path | None = None, grpc_port: int | None = None,
                 health_port: bool = False) -> None:
        """`health_port`: health also on a plaintext port of its own (needed
        to probe a pod whose gRPC port demands mutual TLS)."""
        # A fixed port lets a restarted pod come back at the same address.
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.grpc_port}"
        self.log_path = Path(log_path) if log_path else None
        args = ["engine", "--model", str(model), "--host", "127.0.0.1", "--grpc-port", str(self.grpc_port),
                "--metrics-port", str(self.metrics_port)]
        self.health_address = self.address
        if health_port:
            port = free_port()
            self.health_address = f"127.0.0.1:{port}"
            args += ["--health-port", str(port)]
        super().__init__([*args, *extra_args], env, log_path)

    def health(self, timeout: float = 1.0) -> int | None:
        return health_status(self.health_address, timeout)

    def wait_serving(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive("engine pod")
            if self.health() == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        raise TimeoutError(f"engine pod not serving after {timeout}s")


class SimulatedPodsProcess(ChildProcess):
    """``tessera engine --simulate PROFILE --simulated-pods N``: N simulated
    pods in one process, on consecutive gRPC (and metrics) ports."""

    def __init__(self, model: str | Path, profile: str | Path, num_pods: int, extra_args: list[str] = (),
                 env: dict | None = None, log_path: str | Path | None = None, grpc_port: int | None = None) -> None:
        """``grpc_port``: the first pod's (a fleet that comes back at the same addresses); default free ports."""
        if grpc_port is None:
            first = free_port_range(2 * num_pods)
            metrics = first + num_pods
        else:
            first, metrics = grpc_port, free_port_range(num_pods)
        self.grpc_ports = list(range(first, first + num_pods))
        self.metrics_ports = list(range(metrics, metrics + num_pods))
        self.addresses = [f"127.0.0.1:{port}" for port in self.grpc_ports]
        self.log_path = Path(log_path) if log_path else None
        args = ["engine", "--model", str(model), "--simulate", str(profile), "--simulated-pods", str(num_pods),
                "--host", "127.0.0.1", "--grpc-port", str(first), "--metrics-port", str(metrics)]
        super().__init__([*args, *extra_args], env, log_path)

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.addresses)
        while pending and time.monotonic() < deadline:
            self.check_alive("simulated pods")
            pending = [a for a in pending if health_status(a) != health_pb2.HealthCheckResponse.SERVING]
            if pending:
                time.sleep(0.1)
        if pending:
            raise TimeoutError(f"simulated pods {pending} not serving after {timeout}s")
