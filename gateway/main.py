"""``tessera gateway --config FILE``: REST (OpenAI-compatible) and gRPC
(tessera.v1.Inference) on one asyncio loop, in front of the engine pods.
The command's arguments are gateway/cli.py's.

SIGTERM/SIGINT: stop accepting, let in-flight requests finish (up to the
drain timeout), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from gateway.batch.runner import BatchRunner
from gateway.batch.signing import batch_mac_key
from gateway.batch.store import BatchStore, open_store
from gateway.config import GatewayConfig, GatewayConfigError, InternalConfig, load_gateway_config
from gateway.grpc_service import InferenceService
from gateway.grpc_service import add_to_server as add_inference_service
from gateway.model import ServedModel
from gateway.openai_api.server import build_app
from gateway.pods.discovery import EndpointSliceWatcher, FileWatcher, static_members
from gateway.priority import PriorityClasses
from gateway.serving import Gateway
from gateway.tenants import TenantRegistry
from tessera.internal_channel import InternalClient
from tessera.internal_secret import InternalSecret, InternalSecretError
from tessera.reflection import enable_server_reflection
from tessera.tracing import configure_tracing
from tessera.v1 import inference_pb2

logger = logging.getLogger(__name__)
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


def run(args: argparse.Namespace) -> int:
    config = load_gateway_config(args.config)
    overrides = {k: v for k, v in (("host", args.host), ("http_port", args.http_port),
                                    ("grpc_port", args.grpc_port), ("metrics_port", args.metrics_port))
                 if v is not None}
    if overrides:
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, **overrides))
    configure_tracing("tessera-gateway")
    asyncio.run(serve(config, args.drain_timeout))
    return 0


def internal_client(config: InternalConfig) -> InternalClient:
    """The credentials the gateway presents to engine pods. No secret, no
    gateway: the pods would refuse every call."""
    try:
        secret = InternalSecret.require("engine pods accept only callers holding the deployment's internal secret",
                                        config.secret_file, setting="internal.secret_file")
    except InternalSecretError as e:
        raise GatewayConfigError(str(e)) from None
    try:
        return InternalClient(secret, config.tls)
    except ValueError as e:
        raise GatewayConfigError(f"internal.tls.{e}") from None


def build_gateway(config: GatewayConfig) -> Gateway:
    internal = internal_client(config.internal)
    model = ServedModel.load(config.model)
    tenants = (TenantRegistry.load(config.tenants_file, internal.secret) if config.tenants_file
               else TenantRegistry.open_access(internal.secret))
    items = [dataclasses.asdict(c) for c in config.priority_classes] if config.priority_classes else None
    classes = PriorityClasses.from_config(items, config.default_priority_class)
    classes.validate_tenants(tenants.tenants)
    if not config.tenants_file:
        logger.warning("no tenants_file: every request is served without an API key (open access)")
    _warn_unknown_allowed_models(config, tenants)
    return Gateway(config, model, tenants, classes, internal=internal)


def _warn_unknown_allowed_models(config: GatewayConfig, tenants: TenantRegistry) -> None:
    """A tenant's allowed_models may name adapters loaded later (admin endpoint,
    pods' flags), so a name unknown now is no error; but it is often a typo."""
    known = {config.model.name} | {lora.name for lora in config.model.loras}
    for tenant in tenants.tenants:
        unknown = sorted((tenant.allowed_models or frozenset()) - known)
        if unknown:
            logger.warning("tenant %r: allowed_models names %s, neither the model %r nor an adapter of "
                           "model.loras (fine for adapters the pods serve or an admin loads later)",
                           tenant.name, unknown, config.model.name)


async def serve(config: GatewayConfig, drain_timeout: float = 30.0) -> None:
    gateway = build_gateway(config)
    batch_store, batch_runner = _batch_api(config, gateway)
    # Everything loaded so far (transformers, the tokenizer) lives as long as
    # the process: keep it out of the cyclic GC's scans, which would otherwise
    # pause requests for tens of milliseconds.
    gc.collect()
    gc.freeze()
    metrics_server = _serve_metrics(config, gateway)
    gateway.loop_lag.start()
    for role, addresses in static_members(config.pods).items():
        gateway.pool.set_members(role, addresses)
    watcher: EndpointSliceWatcher | FileWatcher | None = None
    if config.pods.kubernetes is not None:
        watcher = EndpointSliceWatcher(config.pods.kubernetes, gateway.pool, asyncio.get_running_loop())
    elif config.pods.file is not None:
        watcher = FileWatcher(config.pods.file, gateway.pool)
    if watcher is not None:
        watcher.start()

    grpc_server = grpc.aio.server()
    health_servicer = health.aio.HealthServicer()
    add_inference_service(InferenceService(gateway), grpc_server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME), grpc_server)  # v1 and v1alpha
    address = f"{config.server.host}:{config.server.grpc_port}"
    if grpc_server.add_insecure_port(address) == 0:
        raise OSError(f"gRPC: cannot listen on {address}")
    await grpc_server.start()
    health_task = asyncio.create_task(_track_health(gateway, health_servicer))

    if batch_runner is not None:
        batch_runner.start()
    app = build_app(gateway, batch_store)
    http = _HttpServer(uvicorn.Config(
        app, host=config.server.host, port=config.server.http_port, log_level="warning", access_log=False,
        lifespan="off", timeout_graceful_shutdown=int(drain_timeout), timeout_keep_alive=config.server.keep_alive_s,
    ))
    logger.info("gateway: REST on %s:%d, gRPC on %s, model %s", config.server.host, config.server.http_port,
                address, config.model.name)
    loop = asyncio.get_running_loop()

    def on_stop_signal() -> None:
        http.request_exit()
        if batch_runner is not None:
            batch_runner.begin_drain()  # batch lines in flight drain alongside the HTTP requests

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop_signal)
    try:
        await http.serve()  # returns after SIGINT/SIGTERM, once in-flight HTTP requests finish
    finally:
        await health_servicer.enter_graceful_shutdown()
        await grpc_server.stop(drain_timeout)
        health_task.cancel()
        gateway.loop_lag.stop()
        if watcher is not None:
            watcher.stop()
        if batch_runner is not None:
            # Lines still in flight when the drain time is up are run again by whoever resumes the batch.
            await batch_runner.stop(grace_s=drain_timeout)
            await batch_store.close()
        await gateway.close()
        if metrics_server is not None:
            metrics_server.shutdown()


def _batch_api(config: GatewayConfig, gateway: Gateway) -> tuple[BatchStore | None, BatchRunner | None]:
    """The Batch API's store and runner (docs/batch.md), or none without a `batch` section."""
    if config.batch is None:
        return None, None
    try:
        client = gateway.pool.client  # holds the internal secret (build_gateway): its key signs the records
        store = open_store(config.batch, batch_mac_key(client.secret if client is not None else None))
        return store, BatchRunner(gateway, store, config.batch)
    except (ValueError, OSError) as e:
        raise GatewayConfigError(f"batch: {e}") from None


def _serve_metrics(config: GatewayConfig, gateway: Gateway):
    """Prometheus /metrics on server.metrics_port (a thread of its own), never
    on the public REST port: they name every tenant. None when disabled."""
    port = config.server.metrics_port
    if not port:
        return None
    server, _ = start_http_server(port, addr=config.server.host, registry=gateway.metrics.registry)
    logger.info("gateway: metrics on %s:%d/metrics", config.server.host, port)
    return server


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: it would re-raise SIGTERM
    after its shutdown and kill the process before the gRPC server drains."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def request_exit(self) -> None:
        if self.should_exit:  # a second signal: stop waiting for in-flight requests
            self.force_exit = True
        self.should_exit = True


async def _track_health(gateway: Gateway, servicer) -> None:
    """SERVING while the gateway takes requests (Gateway.ready)."""
    last = None
    while True:
        status = (health_pb2.HealthCheckResponse.SERVING if gateway.ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        if status != last:
            for name in ("", SERVICE_NAME):
                await servicer.set(name, status)
            last = status
        await asyncio.sleep(0.25)
