"""Start an engine pod as a child process and wait until it serves.

Used by tests, benchmarks and (later) the local platform runner: the same
`tessera engine` command a Kubernetes pod runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EnginePodProcess:
    def __init__(self, model: str | Path, extra_args: list[str] = (), env: dict | None = None,
                 log_path: str | Path | None = None, grpc_port: int | None = None) -> None:
        # A fixed port lets a restarted pod come back at the same address.
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.grpc_port}"
        cmd = [
            sys.executable, "-m", "tessera.cli", "engine", "--model", str(model), "--host", "127.0.0.1",
            "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port), *extra_args,
        ]
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=self._log, stderr=subprocess.STDOUT)

    def health(self, timeout: float = 1.0) -> int | None:
        """The health status, or None if the pod does not answer."""
        with grpc.insecure_channel(self.address) as channel:
            try:
                resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            except grpc.RpcError:
                return None
        return resp.status

    def wait_serving(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine pod exited with {self.proc.returncode} before serving")
            if self.health() == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        raise TimeoutError(f"engine pod not serving after {timeout}s")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code (killing it after the timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "EnginePodProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()
