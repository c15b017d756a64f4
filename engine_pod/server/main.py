"""``tessera engine``: the process of an engine pod.

Threads: the engine loop runs on the main thread (see async_engine.py for
why); the gRPC server, health service and request streams run on an
asyncio loop in a second thread.

Start-up: the gRPC port opens first and answers health NOT_SERVING while the
model loads and warms up; then SERVING. SIGTERM (or SIGINT): NOT_SERVING,
new requests get UNAVAILABLE, in-flight ones finish within the drain
timeout (the rest are aborted), exit 0. A multi-node leader still waiting
for its other nodes, or a node for its leader, stops waiting at once
(distributed/join_stop.py) and exits 0.

Callers: every method but health needs the deployment's internal token
(auth.py; the secret comes from TESSERA_INTERNAL_SECRET_FILE or
TESSERA_INTERNAL_SECRET, never the command line), and with --tls-* flags a
client certificate too. No secret, no pod, unless --no-internal-auth.

Simulated pods (--simulate PROFILE): the same server, scheduler and KV cache
manager, with the model forward replaced by a step-time model
(executor/simulated.py); no torch is imported. One process can host many
(--simulated-pods N, on consecutive ports), each with its own engine loop
thread, sharing the one gRPC event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import itertools
import logging
import signal
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import start_http_server

from engine_pod.config import EngineConfig, create_engine_config
from engine_pod.distributed.join_stop import JOIN_STOP, JoinStopped
from engine_pod.engine.engine_core import EngineCore
from engine_pod.entrypoints.cli_args import add_engine_args, add_node_args, engine_kwargs, node_layout
from engine_pod.executor.abstract import Executor
from engine_pod.executor.simulated import SimulatedExecutor
from engine_pod.processor import Processor
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams
from engine_pod.server.async_engine import AsyncEngine, StreamEnd
from engine_pod.server.auth import InternalAuthInterceptor, ServerTLS
from engine_pod.server.cpu_share import cpu_share
from engine_pod.server.frontend import Frontend, PodServer
from engine_pod.server.grpc_service import EngineService
from engine_pod.server.lora_registry import LoRARegistry, parse_lora_modules
from engine_pod.server.metrics import (
    EngineMetrics,
    InFlightCollector,
    KVStoreCollector,
    LoRACollector,
    PipelineStageCollector,
    StructuredOutputCollector,
)
from engine_pod.server.step_watchdog import watch_steps
from engine_pod.sim.step_profile import StepTimeProfile
from kv_store.inbox_socket import InboxSocket
from tessera.internal_secret import SECRET_ENV, SECRET_FILE_ENV, InternalSecret
from tessera.roles import POD_ROLES
from tessera.text import load_eos_token_ids
from tessera.text.torch_free import hide_torch_from_transformers
from tessera.tracing import configure_tracing

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("engine", help="run an engine pod (gRPC tessera.v1.Engine)")
    add_engine_args(p)
    add_node_args(p)
    p.add_argument("--role", default="mixed", help="mixed, prefill or decode")
    # Loopback unless told otherwise: the Engine API is internal (docs/security.md); the operator
    # passes --host 0.0.0.0 so the gateway can reach the pod across the cluster network.
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (gRPC, health, metrics); 0.0.0.0 for every interface")
    p.add_argument("--grpc-port", type=int, default=50061)
    p.add_argument("--metrics-port", type=int, default=9090, help="0 disables /metrics")
    p.add_argument("--kv-inbox-port", type=int, default=0,
                   help="with --kv-inbox-bytes: also take pushed KV blocks on this TCP port, the direct P/D "
                        "channel's fast data path (a prefill pod gets a one-time ticket over gRPC first; TLS "
                        "under mutual TLS); 0: pushes come over gRPC only")
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
    p.add_argument("--tls-server-name", default=None,
                   help="mutual TLS: the name checked against peer pods' certificates when this pod dials them (the "
                        "direct P/D channel; they must be signed by --tls-client-ca-file); default: the dialled host")
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve from the start (with --enable-lora), by name")
    p.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                   help="a folder LoadLoRAAdapter may read adapters from at run time (repeatable; none: no run-time "
                        "loads)")
    p.add_argument("--step-timeout", type=float, default=60.0,
                   help="seconds one engine step may run before the pod reports itself stalled "
                        "(its streams are ended and routed elsewhere); 0: never")
    p.add_argument("--health-port", type=int, default=0,
                   help="also serve grpc.health.v1 alone, in plaintext, on this port (kubelet probes "
                        "cannot speak TLS); 0: none")
    p.add_argument("--simulate", default=None, metavar="PROFILE",
                   help="run a simulated pod: the real scheduler and KV cache manager, the model forward replaced "
                        "by this step-time profile (JSON, e.g. engine_pod/sim/profiles/bench-cpu.json); no torch")
    p.add_argument("--simulated-pods", type=int, default=1,
                   help="with --simulate: pods this process hosts, on consecutive ports from --grpc-port "
                        "(and from --metrics-port and --health-port when set)")
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
    if (args.lora_modules or args.lora_root) and not args.enable_lora:
        raise ValueError("--lora-modules and --lora-root need --enable-lora")
    n = args.simulated_pods
    if n < 1 or (n > 1 and args.simulate is None):
        raise ValueError(f"simulated_pods must be >= 1, and above 1 only with --simulate, got {n}")
    layout = node_layout(args)
    if layout.nnodes > 1:
        if args.simulate is not None:
            raise ValueError("--nnodes: a simulated pod is one process")
        if InternalSecret.load() is None:
            raise ValueError(f"--nnodes {layout.nnodes}: the nodes authenticate each other with the internal "
                             f"secret; set {SECRET_FILE_ENV} (a file holding it) or {SECRET_ENV}")
        world = args.pipeline_parallel_size * args.tensor_parallel_size
        if world % layout.nnodes:
            raise ValueError(f"nnodes={layout.nnodes} does not divide the world size {world} "
                             f"(pipeline_parallel_size={args.pipeline_parallel_size} x "
                             f"tensor_parallel_size={args.tensor_parallel_size})")
    if args.kv_inbox_port and not args.kv_inbox_bytes:
        raise ValueError("--kv-inbox-port needs --kv-inbox-bytes > 0 (the inbox it fills)")
    ranges = {name: (port, port + n - 1) for name, port in
              (("grpc_port", args.grpc_port), ("metrics_port", args.metrics_port), ("health_port", args.health_port),
               ("kv_inbox_port", args.kv_inbox_port))
              if port}
    for name, (first, last) in ranges.items():
        if not 0 < first <= last <= 65535:
            raise ValueError(f"{name}: ports {first}-{last} ({n} pods) do not fit in 1-65535")
    for (a, (a0, a1)), (b, (b0, b1)) in itertools.combinations(ranges.items(), 2):
        if a0 <= b1 and b0 <= a1:
            raise ValueError(f"{a} {a0}-{a1} and {b} {b0}-{b1} overlap ({n} pods, one port of each per pod)")


def _caller_auth(args: argparse.Namespace) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor that demands the internal token; none with --no-internal-auth."""
    if args.no_internal_auth:
        logger.warning("--no-internal-auth: ANY client that reaches port %d can read and generate from every "
                       "tenant's cached KV; use it only for a pod nobody else can reach", args.grpc_port)
        return []
    secret = InternalSecret.require("engine pods serve only callers holding the deployment's internal secret",
                                    otherwise="pass --no-internal-auth for a pod nobody else can reach")
    return [InternalAuthInterceptor(secret)]


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


def _import_grammar_backend() -> None:
    """xgrammar and the transformers it imports (about a second of start-up) once the pod
    serves, not before it: the first request with a grammar finds them imported."""
    import engine_pod.structured_output.backend_xgrammar  # noqa: F401


async def _lifecycle(pod: _Pod, banner: str, drain_timeout: float, step_timeout: float) -> None:
    """On the frontend loop: warm up, serve until asked to stop, drain, stop the engine."""
    service, server, engine = pod.service, pod.server, pod.engine
    watchdog = None
    try:
        await _warm_up(engine, pod.processor)
        engine.on_step = pod.metrics.on_step  # the warm-up stays out of the metrics
        service.serving = True
        await server.set_health(health_pb2.HealthCheckResponse.SERVING)
        print(banner, flush=True)
        if pod.core.structured_output is not None:
            threading.Thread(target=_import_grammar_backend, name="import-xgrammar", daemon=True).start()
        if step_timeout:
            watchdog = asyncio.create_task(watch_steps(engine, service, server.set_health, step_timeout))
        await server.stop_requested.wait()
        service.serving = False
        await server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        logger.info("draining %d in-flight requests (up to %.0fs)", engine.num_in_flight, drain_timeout)
        deadline = asyncio.get_running_loop().time() + drain_timeout
        while engine.num_in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        engine.stop()


@dataclass
class _Pod:
    """One pod's parts; a host of simulated pods has many."""

    service: EngineService
    server: PodServer
    processor: Processor
    metrics: EngineMetrics
    metrics_port: int
    kv_inbox_port: int
    core: EngineCore | None = None
    engine: AsyncEngine | None = None


def _pods(args: argparse.Namespace, config: EngineConfig, model_name: str, interceptors, tls) -> list[_Pod]:
    pods = []
    for i in range(args.simulated_pods):
        processor = Processor(config, tokenizer=None, eos_token_ids=load_eos_token_ids(config.model.path))
        metrics = EngineMetrics(model_name)
        adapters = LoRARegistry(processor, args.lora_root)
        for name, path in parse_lora_modules(args.lora_modules):
            adapters.register(name, path, from_flags=True)
        service = EngineService(processor, metrics, args.role, args.max_waiting_requests, adapters)
        health_address = f"{args.host}:{args.health_port + i}" if args.health_port else None
        server = PodServer(service, f"{args.host}:{args.grpc_port + i}", interceptors, tls, health_address)
        pods.append(_Pod(service, server, processor, metrics, args.metrics_port + i if args.metrics_port else 0,
                         args.kv_inbox_port + i if args.kv_inbox_port else 0))
    return pods


def _executor_factory(args: argparse.Namespace, config: EngineConfig) -> Callable[[], Executor | None]:
    """What each pod's engine core runs steps on: the model (None: the
    default executor) or, simulated, the profile's step-time model."""
    if args.simulate is None:
        import torch  # here: a simulated pod never loads it

        if config.device.type == "cpu":
            threads = args.cpu_threads or cpu_share()
            torch.set_num_threads(threads)
            # Under tensor and pipeline parallelism the ranks compute and share the pod's CPUs.
            config.parallel.worker_threads = max(1, threads // config.parallel.local_world_size)
        return lambda: None
    profile = StepTimeProfile.load(args.simulate)
    return lambda: SimulatedExecutor(config, profile)


def _start_pod(pod: _Pod, config: EngineConfig, executor: Executor | None, loop, model_name: str, host: str,
               tls: ServerTLS | None) -> None:
    if pod.metrics_port:
        try:
            start_http_server(pod.metrics_port, addr=host, registry=pod.metrics.registry)
        except OSError as e:
            raise ValueError(f"--metrics-port: cannot listen on {host}:{pod.metrics_port}: "
                             f"{e.strerror or e}") from None
    pod.core = EngineCore(config, executor)
    if pod.core.kv_store is not None:
        pod.metrics.registry.register(KVStoreCollector(pod.core.kv_store, model_name))
    if pod.kv_inbox_port:
        store = pod.core.kv_store
        pod.service.inbox_socket = InboxSocket(store.receive, store.value_bytes, (host, pod.kv_inbox_port),
                                               tls.ssl_context() if tls is not None else None)
    if pod.core.structured_output is not None:
        pod.metrics.registry.register(StructuredOutputCollector(pod.core.structured_output.stats, model_name))
    if pod.core.lora_loader is not None:
        pod.metrics.registry.register(LoRACollector(pod.service.adapters, pod.core.lora_loader, model_name))
    pod.engine = AsyncEngine(pod.core, loop)
    pod.metrics.registry.register(InFlightCollector(pod.engine.in_flight, model_name))
    if config.parallel.pipeline_parallel_size > 1:
        pod.metrics.registry.register(PipelineStageCollector(pod.core.executor, model_name))
    pod.service.attach(pod.engine)


def _run_engines(pods: list[_Pod]) -> list[BaseException]:
    """Every pod's engine loop until its lifecycle stops it: the first on
    this (the main) thread, where torch's CPU kernels run fastest
    (async_engine.py); a host of simulated pods runs the others on threads.
    Returns the failures of the pods that failed."""
    failures: list[BaseException] = []

    def run(engine: AsyncEngine) -> None:
        try:
            engine.run()
        except BaseException as e:  # noqa: BLE001 - this pod failed, its streams were told; the others serve on
            failures.append(e)

    threads = [threading.Thread(target=run, args=(pod.engine,), name=f"engine-{i}", daemon=True)
               for i, pod in enumerate(pods[1:], start=1)]
    for thread in threads:
        thread.start()
    pods[0].engine.run()  # a failure of the only (or first) pod ends the process, as before
    for thread in threads:
        thread.join()
    return failures


def serve(args: argparse.Namespace) -> int:
    _validate(args)
    if args.simulate is not None:
        # A simulated pod must stay torch-free (hundreds share one machine):
        # any import of it from here on fails loudly instead of costing
        # seconds and hundreds of MiB unnoticed.
        hide_torch_from_transformers()
    interceptors = _caller_auth(args)
    tls = ServerTLS.from_flags(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    if tls is not None:
        tls.credentials()  # unreadable files fail before the model loads
    config = create_engine_config(args.model, **engine_kwargs(args), simulate=args.simulate is not None,
                                  nodes=node_layout(args))
    if not config.parallel.nodes.is_leader:
        return _serve_node(args, config)
    if tls is not None:
        # Peers demand a client certificate as this pod does: it dials them (a direct push) with its own.
        config.kv_store.peer_tls = tls.as_client(args.tls_server_name)
    new_executor = _executor_factory(args, config)
    model_name = args.served_model_name or config.model.path.name
    configure_tracing("tessera-engine")
    pods = _pods(args, config, model_name, interceptors, tls)
    frontend = Frontend([pod.server for pod in pods])
    frontend.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, functools.partial(_on_stop_signal, frontend))
    group_failure: list[str] = []

    def fail_group(message: str) -> None:
        # Another node of this engine was lost while no step ran: stop serving and exit
        # non-zero (the pod restarts with its group); a step in flight fails on its own.
        logger.error("engine group failed: %s; stopping the pod", message)
        group_failure.append(message)
        frontend.request_stop()

    try:
        for pod in pods:
            _start_pod(pod, config, new_executor(), frontend.loop, model_name, args.host, tls)
            if hasattr(pod.core.executor, "on_group_failure"):
                pod.core.executor.on_group_failure = fail_group
        # The model, tokenizer and libraries loaded so far live as long as the process: out of the
        # cyclic GC's scans, whose full passes over them would otherwise stall steps and streams.
        gc.collect()
        gc.freeze()
        auth = "off" if not interceptors else "token+mtls" if tls else "token"
        kind = " simulated" if config.simulated else ""
        lifecycles = [frontend.submit(_lifecycle(
            pod, f"tessera engine ready:{kind} role={args.role} grpc={pod.server.address} auth={auth} "
                 f"metrics=:{pod.metrics_port} kv_blocks={pod.core.num_blocks}"
                 + (f" kv_inbox=:{pod.kv_inbox_port}" if pod.kv_inbox_port else ""),
            args.drain_timeout, args.step_timeout)) for pod in pods]
        failures = _run_engines(pods)
        for lifecycle in lifecycles:
            lifecycle.result(timeout=30)
        for pod in pods:
            pod.core.shutdown()
    except JoinStopped as e:
        # Stopped before the group formed: the executor stopped its ranks; a pod being stopped exits 0.
        logger.warning("engine group: %s; exiting without serving", e)
        print("tessera engine stopped", flush=True)
        return 0
    finally:
        frontend.close()
        for pod in pods:
            if pod.service.inbox_socket is not None:
                pod.service.inbox_socket.close()
    for failure in failures:
        logger.error("a simulated pod's engine loop failed: %r", failure)
    print("tessera engine stopped", flush=True)
    return 1 if failures or group_failure else 0


def _on_stop_signal(frontend: Frontend, *_) -> None:
    """SIGTERM/SIGINT: a serving pod drains; a leader still waiting for its
    group's other nodes stops waiting (distributed/join_stop.py)."""
    JOIN_STOP.set()
    frontend.request_stop()


def _serve_node(args: argparse.Namespace, config: EngineConfig) -> int:
    """``--node-rank K > 0``: only this node's ranks, relaying the leader's
    calls; exits non-zero when the group fails (the pod restarts)."""
    from engine_pod.executor.node_follower import run_node

    _executor_factory(args, config)  # the CPU threads of the ranks
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    status = run_node(config, stop)
    print(f"tessera engine node {config.parallel.nodes.node_rank} stopped (status {status})", flush=True)
    return status
