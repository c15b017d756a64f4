"""``tessera engine``: the process of an engine pod.

Threads: the engine loop runs on the main thread (see async_engine.py for
why); the gRPC server, health service and request streams run on an
asyncio loop in a second thread.

Start-up: the gRPC port opens first and answers health NOT_SERVING while the
model loads and warms up; then SERVING. SIGTERM (or SIGINT): NOT_SERVING,
new requests get UNAVAILABLE, in-flight ones finish within the drain
timeout (the rest are aborted), exit 0.

Callers: every method but health needs the deployment's internal token
(auth.py; the secret comes from TESSERA_INTERNAL_SECRET_FILE or
TESSERA_INTERNAL_SECRET, never the command line), and with --tls-* flags a
client certificate too. No secret, no pod, unless --no-internal-auth.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
import uuid
from collections.abc import Coroutine

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from engine_pod.config import create_engine_config
from engine_pod.engine.engine_core import EngineCore
from engine_pod.entrypoints.cli_args import add_engine_args, engine_kwargs
from engine_pod.processor import Processor
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams
from engine_pod.server.async_engine import AsyncEngine, StreamEnd
from engine_pod.server.auth import InternalAuthInterceptor, ServerTLS
from engine_pod.server.grpc_service import EngineService
from engine_pod.server.step_watchdog import watch_steps
from engine_pod.server.cpu_share import cpu_share
from engine_pod.server.metrics import EngineMetrics, KVStoreCollector, StructuredOutputCollector
from tessera.internal_secret import InternalSecret
from tessera.roles import POD_ROLES
from tessera.tracing import configure_tracing
from tessera.text import load_eos_token_ids
from tessera.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


def add_parser(sub) -> None:
    p = sub.add_parser("engine", help="run an engine pod (gRPC tessera.v1.Engine)")
    add_engine_args(p)
    p.add_argument("--role", default="mixed", help="mixed, prefill or decode")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--grpc-port", type=int, default=50061)
    p.add_argument("--metrics-port", type=int, default=9090, help="0 disables /metrics")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="beyond this many queued requests, Generate answers RESOURCE_EXHAUSTED")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--served-model-name", default=None, help="model label on metrics (default: the folder name)")
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="torch threads on CPU (0: the pod's CPU share: affinity capped by the cgroup quota)")
    p.add_argument("--no-internal-auth", action="store_true",
                   help="serve callers without the internal token (only for a pod nobody else can reach)")
    p.add_argument("--tls-cert-file", default=None, help="mutual TLS: this pod's certificate (PEM)")
    p.add_argument("--tls-key-file", default=None, help="mutual TLS: this pod's private key (PEM)")
    p.add_argument("--tls-client-ca-file", default=None,
                   help="mutual TLS: the CA that must have signed every client's certificate (PEM)")
    p.add_argument("--step-timeout", type=float, default=60.0,
                   help="seconds one engine step may run before the pod reports itself stalled "
                        "(its streams are ended and routed elsewhere); 0: never")
    p.add_argument("--health-port", type=int, default=0,
                   help="also serve grpc.health.v1 alone, in plaintext, on this port (kubelet probes "
                        "cannot speak TLS); 0: none")
    p.set_defaults(func=serve)


def _validate(args: argparse.Namespace) -> None:
    if args.role not in POD_ROLES:
        raise ValueError(f"role: {args.role!r} is not one of {POD_ROLES}")
    if args.max_waiting_requests < 1:
        raise ValueError("max_waiting_requests must be >= 1")
    if args.drain_timeout < 0:
        raise ValueError("drain_timeout must be >= 0")
    if args.cpu_threads < 0:
        raise ValueError("cpu_threads must be >= 0 (0: the pod's CPU share)")
    if args.step_timeout < 0:
        raise ValueError("step_timeout must be >= 0 (0: never)")
    if args.health_port and args.health_port == args.grpc_port:
        raise ValueError("health_port must differ from grpc_port")


def _caller_auth(args: argparse.Namespace) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor that demands the internal token; none with --no-internal-auth."""
    if args.no_internal_auth:
        logger.warning("--no-internal-auth: ANY client that reaches port %d can read and generate from every "
                       "tenant's cached KV; use it only for a pod nobody else can reach", args.grpc_port)
        return []
    secret = InternalSecret.require("engine pods serve only callers holding the deployment's internal secret",
                                    otherwise="pass --no-internal-auth for a pod nobody else can reach")
    return [InternalAuthInterceptor(secret)]


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


class Frontend:
    """The gRPC server and its asyncio loop, on their own thread."""

    def __init__(self, service: EngineService, address: str, interceptors: list[grpc.aio.ServerInterceptor],
                 tls: ServerTLS | None = None, health_address: str | None = None) -> None:
        self.service = service
        self.address = address
        self.interceptors = interceptors
        self.tls = tls
        # A plaintext server of health alone, beside a TLS port (kubelet probes).
        self.health_address = health_address
        self.health_server: grpc.aio.Server | None = None
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, name="grpc-frontend", daemon=True)
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.stop_requested: asyncio.Event | None = None

    def start(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._open())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    async def _open(self) -> None:
        self.stop_requested = asyncio.Event()
        server = grpc.aio.server(interceptors=self.interceptors, options=_SERVER_OPTIONS)
        engine_pb2_grpc.add_EngineServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
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

    def submit(self, coro: Coroutine):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def request_stop(self) -> None:
        """Thread- and signal-safe: begin the drain."""
        self.loop.call_soon_threadsafe(self.stop_requested.set)

    def close(self) -> None:
        async def _close():
            for server in (self.server, self.health_server):
                if server is not None:
                    await server.stop(grace=1.0)
        if self.loop.is_running():
            self.submit(_close()).result(timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


async def _warm_up(engine: AsyncEngine, processor: Processor) -> None:
    """One short request end to end, so the first real one pays no first-call costs."""
    num_tokens = max(1, min(16, engine.core.config.model.max_model_len - 1))
    prompt = processor.process_prompt({"prompt_token_ids": [0] * num_tokens})
    params = processor.process_params(SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    queue = engine.add_request(Request(f"warmup-{uuid.uuid4().hex}", prompt.prompt_token_ids, params))
    while True:
        item = await queue.get()
        if isinstance(item, StreamEnd):
            raise RuntimeError(f"warm-up failed: {item.error!r}")
        if item.output.finished:
            return


async def _lifecycle(frontend: Frontend, engine: AsyncEngine, processor: Processor, metrics: EngineMetrics,
                     banner: str, drain_timeout: float, step_timeout: float) -> None:
    """On the frontend loop: warm up, serve until asked to stop, drain, stop the engine."""
    service = frontend.service
    watchdog = None
    try:
        await _warm_up(engine, processor)
        engine.on_step = metrics.on_step  # the warm-up stays out of the metrics
        service.serving = True
        await frontend.set_health(health_pb2.HealthCheckResponse.SERVING)
        print(banner, flush=True)
        if step_timeout:
            watchdog = asyncio.create_task(watch_steps(engine, service, frontend.set_health, step_timeout))
        await frontend.stop_requested.wait()
        service.serving = False
        await frontend.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        logger.info("draining %d in-flight requests (up to %.0fs)", engine.num_in_flight, drain_timeout)
        deadline = asyncio.get_running_loop().time() + drain_timeout
        while engine.num_in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        engine.stop()


def serve(args: argparse.Namespace) -> int:
    _validate(args)
    interceptors = _caller_auth(args)
    tls = ServerTLS.from_flags(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    if tls is not None:
        tls.credentials()  # unreadable files fail before the model loads
    config = create_engine_config(args.model, **engine_kwargs(args))
    if config.device.type == "cpu":
        threads = args.cpu_threads or cpu_share()
        torch.set_num_threads(threads)
        # Under tensor parallelism the ranks compute and share the pod's CPUs.
        config.parallel.worker_threads = max(1, threads // config.parallel.tensor_parallel_size)
    model_name = args.served_model_name or config.model.path.name
    processor = Processor(config, tokenizer=None, eos_token_ids=load_eos_token_ids(config.model.path))
    metrics = EngineMetrics(model_name)
    configure_tracing("tessera-engine")
    service = EngineService(processor, metrics, args.role, args.max_waiting_requests)
    health_address = f"{args.host}:{args.health_port}" if args.health_port else None
    frontend = Frontend(service, f"{args.host}:{args.grpc_port}", interceptors, tls, health_address)
    frontend.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: frontend.request_stop())
    try:
        if args.metrics_port:
            try:
                start_http_server(args.metrics_port, addr=args.host, registry=metrics.registry)
            except OSError as e:
                raise ValueError(f"--metrics-port: cannot listen on {args.host}:{args.metrics_port}: "
                                 f"{e.strerror or e}") from None
        core = EngineCore(config)
        if core.kv_store is not None:
            metrics.registry.register(KVStoreCollector(core.kv_store, model_name))
        metrics.registry.register(StructuredOutputCollector(core.structured_output.stats, model_name))
        engine = AsyncEngine(core, frontend.loop)
        service.attach(engine)
        auth = "off" if not interceptors else "token+mtls" if tls else "token"
        banner = (f"tessera engine ready: role={args.role} grpc={frontend.address} auth={auth} "
                  f"metrics=:{args.metrics_port} kv_blocks={core.num_blocks}")
        lifecycle = frontend.submit(
            _lifecycle(frontend, engine, processor, metrics, banner, args.drain_timeout, args.step_timeout)
        )
        engine.run()  # until the lifecycle stops it
        lifecycle.result(timeout=30)
        core.shutdown()
    finally:
        frontend.close()
    print("tessera engine stopped", flush=True)
    return 0
