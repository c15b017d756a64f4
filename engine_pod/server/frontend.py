"""The gRPC side of engine pods: each pod's servers (PodServer), and the
asyncio loop on its own thread that serves them (Frontend).

One process serves one pod, except a host of simulated pods
(``tessera engine --simulate --simulated-pods N``): their servers share the
one loop, each on its own port, as many pods would on many machines.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine_pod.server.auth import ServerTLS
from engine_pod.server.grpc_service import EngineService
from tessera.reflection import enable_server_reflection
from tessera.v1 import engine_pb2, engine_pb2_grpc

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name

# SO_REUSEPORT off: gRPC sets it by default, and a second engine started on
# a taken port would then silently share it (and half the calls).
_SERVER_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)]


def _listen(server: grpc.aio.Server, address: str, flag: str, tls: grpc.ServerCredentials | None) -> None:
    try:
        if tls is None:
            server.add_insecure_port(address)
        else:
            server.add_secure_port(address, tls)
    except RuntimeError:
        raise ValueError(f"{flag}: cannot listen on {address}: the port is taken (another engine pod?) "
                         "or the host is not an address of this machine") from None


class PodServer:
    """One pod's servers: the Engine service with health and reflection on
    its port, and, beside a TLS port, health alone in plaintext (kubelet
    probes cannot speak TLS). Opened, stopped and closed on the Frontend's loop."""

    def __init__(self, service: EngineService, address: str, interceptors: list[grpc.aio.ServerInterceptor],
                 tls: ServerTLS | None = None, health_address: str | None = None) -> None:
        self.service = service
        self.address = address
        self.interceptors = interceptors
        self.tls = tls
        self.health_address = health_address
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.stop_requested: asyncio.Event | None = None

    async def open(self) -> None:
        self.stop_requested = asyncio.Event()
        server = grpc.aio.server(interceptors=self.interceptors, options=_SERVER_OPTIONS)
        engine_pb2_grpc.add_EngineServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME), server)  # v1 and v1alpha
        await self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        _listen(server, self.address, "--grpc-port", self.tls.credentials() if self.tls else None)
        if self.health_address is not None:
            self.health_server = grpc.aio.server(options=_SERVER_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            _listen(self.health_server, self.health_address, "--health-port", None)
            await self.health_server.start()
        await server.start()
        self.server = server

    async def set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def close(self, grace: float | None = 1.0) -> None:
        """Stop listening; ``grace`` None cuts every open call at once (a crash, as its callers see it)."""
        for server in (self.server, self.health_server):
            if server is not None:
                await server.stop(grace=grace)


class Frontend:
    """The asyncio loop serving one or more PodServers, on its own thread."""

    def __init__(self, pods: list[PodServer]) -> None:
        self.pods = pods
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, name="grpc-frontend", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            for pod in self.pods:
                self.loop.run_until_complete(pod.open())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    def submit(self, coro: Coroutine):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def request_stop(self) -> None:
        """Thread- and signal-safe: begin every pod's drain."""
        for pod in self.pods:
            self.loop.call_soon_threadsafe(pod.stop_requested.set)

    def close(self) -> None:
        async def _close():
            for pod in self.pods:
                await pod.close()
        if self.loop.is_running():
            self.submit(_close()).result(timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
