"""From an InferenceService to the local processes that serve it (pure).

The same resource `kubectl apply` takes runs here: validated with the CRD's
schema (the operator's own function, so the errors are the same), with the
engine command lines and the gateway config the operator would render,
changed only where a machine differs from a cluster: loopback ports instead
of Services, a local folder instead of the PVC, cores split between pods.
A pipeline-parallel pool's replica is a group of processes, one per stage,
as the operator's LeaderWorkerSet has pods (group_plan.py).
Credentials stay off the command lines here too: the Redis URL goes in the
engines' environment (`EngineChild.env`) and, for the Batch API, the gateway's
(`LocalPlan.gateway_env`), never in its config file; the runner hands every
child the internal secret as a file.

The Batch API (spec.batch) keeps its files and batches where they outlive a
run: `batch.volume` is a folder under the run's state directory (what
--models-dir is to the model's PVC), `batch.redis` the Redis the run uses for
kvStore.redis.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.config import BATCH_REDIS_URL_ENV
from tessera import child_process
from tessera_operator import engine_pool, gateway, names
from tessera_operator.names import Owner
from tessera_operator.validation import validate_inference_service
from tessera_tools.up.group_plan import NodeChild, local_group, worker_command

KV_INBOX_PORT_FLAG = "--kv-inbox-port"


@dataclass(frozen=True)
class EngineChild:
    name: str            # e.g. "decode-0"
    role: str
    grpc_port: int
    metrics_port: int
    args: list[str]      # `tessera ...` arguments
    cpus: frozenset[int] | None
    # Environment beyond the parent's (the Redis URL, which may carry a password).
    env: dict[str, str] = field(default_factory=dict, repr=False)
    # Where prefill pods push KV blocks (a decode pod of the direct channel); 0: no such listener.
    kv_inbox_port: int = 0
    nodes: tuple[NodeChild, ...] = ()
    """Under pipeline parallelism the group's other nodes: this child is then its leader (node 0,
    stage 0, serving gRPC); empty: one process runs the whole engine."""
    master_port: int = 0
    """A group's rendezvous port on loopback (--master-port; its node channel takes the next one);
    0: no group."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@dataclass
class LocalPlan:
    name: str
    model_name: str
    engines: list[EngineChild]
    gateway_config: dict
    needs_redis: bool
    # The gateway's /metrics (off its public port, as in a cluster).
    metrics_port: int
    warnings: list[str] = field(default_factory=list)
    # spec.batch.volume's folder here (the Batch API's directory store); None: no such store.
    batch_directory: Path | None = None
    # Whether the gateway serves the Batch API (/v1/files, /v1/batches).
    batch: bool = False
    # The gateway's environment beyond the parent's: spec.batch.redis's URL (it may carry a password),
    # else that variable blanked.
    gateway_env: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class LocalOptions:
    models_dir: Path = Path("models")      # where a PVC's `path` is looked up
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    metrics_port: int = 0                   # the gateway's /metrics; 0: a free port
    tenants_file: str | None = None
    redis_url: str | None = None
    cpus: tuple[int, ...] = ()              # default: this process's CPU affinity
    pin_cpus: bool = True
    # What outlives a run (logs, spec.batch.volume's folder); None: .tessera/up/NAME (state_dir()).
    state_dir: Path | None = None
    # A step-time profile: every engine pod simulated (engine_pod/sim; no torch, no model compute).
    simulate: str | None = None


def state_dir(options: LocalOptions, name: str) -> Path:
    """Where a run of the InferenceService `name` keeps what outlives it: its logs and the Batch API's
    folder (the runner's --log-dir, else .tessera/up/NAME)."""
    return options.state_dir if options.state_dir is not None else Path(".tessera/up") / name


def local_batch_directory(volume: dict, state: Path) -> Path:
    """spec.batch.volume here: the claim's `path` under STATE/batch, which stands in for the claim
    (as --models-dir does for the model's), so the files and batches survive a restart of the run."""
    return (state / "batch" / volume.get("path", "")).resolve()


def local_model_path(model: dict, models_dir: Path) -> Path:
    if "hostPath" in model:
        return Path(model["hostPath"]["path"])
    return (models_dir / model["pvc"].get("path", "")).resolve()


def split_cpus(cpus: tuple[int, ...], count: int) -> list[frozenset[int]]:
    """Disjoint CPU sets, one per engine, as even as possible; when there are
    more engines than CPUs they share round-robin."""
    if count <= len(cpus):
        size = len(cpus) // count
        return [frozenset(cpus[i * size:(i + 1) * size]) for i in range(count)]
    return [frozenset({cpus[i % len(cpus)]}) for i in range(count)]


def build_plan(resource: dict, options: LocalOptions, free_port: Callable[[], int],
               free_port_pair: Callable[[], int] = child_process.free_port_pair) -> LocalPlan:
    """`free_port` gives a free loopback port (two per engine: gRPC, metrics; a third for a decode pod's
    KV inbox; one for the gateway's metrics); `free_port_pair` a port P with P + 1 free too (a
    pipeline-parallel engine's rendezvous port and its node channel's)."""
    obj = validate_inference_service(resource)
    spec, owner = obj["spec"], Owner.of(obj)
    model_path = local_model_path(spec["model"], options.models_dir)
    if not (model_path / "config.json").is_file():
        raise ValueError(f"spec.model: no checkpoint at {model_path} (config.json missing); "
                         "build one with `tessera make-model` or pass --models-dir")
    roles = names.active_pools(spec["mode"])
    replicas = [(role, i) for role in roles for i in range(spec["pools"][role]["replicas"])]
    # Processes per replica: one per pipeline stage, as the operator's LeaderWorkerSet has pods (a
    # simulated pod computes nothing and stays one process: the engine refuses --nnodes with --simulate).
    sizes = [1 if options.simulate else engine_pool.pool_pipeline_parallel_size(spec, role) for role, _ in replicas]
    cpus = options.cpus or tuple(sorted(os.sched_getaffinity(0)))
    # Every process of every group gets its share: the stages compute at the same time.
    cpu_sets = split_cpus(cpus, sum(sizes)) if options.pin_cpus else [None] * sum(sizes)
    default_threads = max(1, len(cpus) // sum(sizes))
    redis_env = {}
    if "redis" in spec["kvStore"] and options.redis_url:
        redis_env[engine_pool.REDIS_URL_ENV] = options.redis_url  # may carry a password: never an argument
    engines = []
    for (role, index), size in zip(replicas, sizes):
        sets, cpu_sets = cpu_sets[:size], cpu_sets[size:]
        threads = [len(cpu_set) if cpu_set else default_threads for cpu_set in sets]
        args = engine_pool.engine_args(owner, spec, role)
        grpc_port, metrics_port = free_port(), free_port()
        # The operator's pods share KV_INBOX_PORT; here each decode pod needs a loopback port of its own.
        kv_inbox_port = free_port() if KV_INBOX_PORT_FLAG in args else 0
        local = functools.partial(_local_args, model_path=model_path, ports=(grpc_port, metrics_port, kv_inbox_port),
                                  spec=spec, options=options)
        name, args = f"{role}-{index}", local(args, threads[0])
        engine = EngineChild(name, role, grpc_port, metrics_port, args, sets[0], dict(redis_env), kv_inbox_port)
        if size > 1:
            worker = worker_command(owner, spec, role)
            group = local_group(spec, role, name, args, [local(worker, t) for t in threads[1:]], free_port_pair(),
                                sets)
            engine = dataclasses.replace(engine, args=group.leader_args, nodes=group.nodes,
                                         master_port=group.master_port)
        engines.append(engine)
    gateway_metrics_port = options.metrics_port or free_port()
    config = _gateway_config(owner, spec, model_path, engines, options, gateway_metrics_port)
    batch_directory, gateway_env = _local_batch(config, spec, options, owner.name)
    return LocalPlan(owner.name, spec["model"]["name"], engines, config,
                     needs_redis="redis" in spec["kvStore"], metrics_port=gateway_metrics_port,
                     warnings=_warnings(spec), batch_directory=batch_directory, batch="batch" in config,
                     gateway_env=gateway_env)


def _local_batch(config: dict, spec: dict, options: LocalOptions, name: str) -> tuple[Path | None, dict[str, str]]:
    """The gateway config's `batch` made local: a folder under the state directory for a volume;
    for redis, the URL of the run's kvStore.redis, in the gateway's environment as the operator's
    pods get it (BATCH_REDIS_URL_ENV), never in its config file. Returns the folder, if any, and
    that environment."""
    # Without batch.redis, a URL inherited from this shell is blanked (empty counts as unset): the
    # gateway would keep batches there rather than in the folder.
    section = config.get("batch")
    if section is None:
        return None, {BATCH_REDIS_URL_ENV: ""}
    if "volume" in spec["batch"]:
        folder = local_batch_directory(spec["batch"]["volume"], state_dir(options, name))
        section["directory"] = str(folder)
        return folder, {BATCH_REDIS_URL_ENV: ""}
    if "redis" not in spec["kvStore"]:
        raise ValueError("spec.batch.redis: `tessera up` keeps batches in the Redis it runs for kvStore.redis "
                         "(its own redis-server, or --redis-url), and this resource has no kvStore.redis: add "
                         "one, or keep batches in a folder with spec.batch.volume")
    if not options.redis_url:
        raise ValueError("spec.batch.redis: no Redis URL for kvStore.redis (pass --redis-url)")
    # batch.redis.tls names Kubernetes Secrets (mounted files in a pod): the run's Redis is used as given.
    for key in ("redis_ca_file", "redis_cert_file", "redis_key_file"):
        section.pop(key, None)
    return None, {BATCH_REDIS_URL_ENV: options.redis_url}  # may carry a password: never in a file or argument


def _local_args(args: list[str], threads: int, model_path: Path, ports: tuple[int, int, int], spec: dict,
                options: LocalOptions) -> list[str]:
    """An operator's engine command made local: this machine's folders, loopback ports (`ports`:
    gRPC, metrics, KV inbox; each set only where the command has its flag), `threads` CPU threads."""
    args = _local_engine_args(args, model_path, *ports, threads)
    if options.simulate:
        args = _simulated_engine_args(args, options.simulate)
    return _local_lora_args(args, spec, options.models_dir)


def _local_engine_args(args: list[str], model_path: Path, grpc_port: int, metrics_port: int, kv_inbox_port: int,
                       threads: int) -> list[str]:
    replace = {"--model": str(model_path), "--host": "127.0.0.1", "--grpc-port": str(grpc_port),
               "--metrics-port": str(metrics_port), KV_INBOX_PORT_FLAG: str(kv_inbox_port)}
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg in replace:
            out[i + 1] = replace[arg]
    return out + ["--cpu-threads", str(threads)]


def _simulated_engine_args(args: list[str], profile: str) -> list[str]:
    """A pod that simulates its steps with `profile`: it computes in no dtype, so the resource's
    model.dtype gives way to auto (the KV pool is sized in the checkpoint's stored dtype)."""
    out = list(args)
    out[out.index("--dtype") + 1] = "auto"
    return out + ["--simulate", profile]


def _local_lora_args(args: list[str], spec: dict, models_dir: Path) -> list[str]:
    """The adapters' folders (--lora-modules, --lora-root) where this machine has them: looked up
    like the model's (a PVC's path under models_dir, a hostPath as it is), not where a pod mounts them."""
    out = list(args)
    if spec.get("loras"):
        start = out.index("--lora-modules") + 1
        local = [f"{a['name']}={local_model_path(a, models_dir)}" for a in spec["loras"]]
        out[start : start + len(local)] = local
    roots = [str(local_model_path(r, models_dir)) for r in (spec["engine"].get("lora") or {}).get("runtimeRoots", [])]
    positions = [i + 1 for i, arg in enumerate(out[:-1]) if arg == "--lora-root"]
    for position, root in zip(positions, dict.fromkeys(roots)):
        out[position] = root
    return out


def _gateway_config(owner: Owner, spec: dict, model_path: Path, engines: list[EngineChild],
                    options: LocalOptions, metrics_port: int) -> dict:
    config = gateway.gateway_config(owner, spec)
    config["model"]["path"] = str(model_path)
    config["server"] = {"host": options.host, "http_port": options.http_port, "grpc_port": options.grpc_port,
                        "metrics_port": metrics_port}
    config["pods"] = {"static": [{"address": e.address, "role": e.role} for e in engines]}
    # Mutual TLS names a Kubernetes Secret; locally the token alone authenticates.
    config.pop("internal", None)
    config.pop("tenants_file", None)
    if options.tenants_file:
        config["tenants_file"] = options.tenants_file
    return config


def _warnings(spec: dict) -> list[str]:
    out = []
    if spec["gateway"].get("tenantsSecretRef"):
        out.append("gateway.tenantsSecretRef names a Kubernetes Secret; locally, pass --tenants-file "
                   "(without it the gateway runs open access)")
    if spec.get("internalSecretRef"):
        out.append("internalSecretRef names a Kubernetes Secret; locally each run generates its own internal secret")
    if spec.get("internalTLS"):
        out.append("internalTLS names a Kubernetes Secret; locally the internal hops use the bearer token alone")
    if (spec["kvStore"].get("redis") or {}).get("tls"):
        out.append("kvStore.redis.tls names Kubernetes Secrets; locally --redis-url is used as given")
    if "redis" in (spec.get("batch") or {}):
        out.append("batch.redis.urlSecretRef names a Kubernetes Secret; locally batches are kept in "
                   "kvStore.redis's Redis")
        if spec["batch"]["redis"].get("tls"):
            out.append("batch.redis.tls names Kubernetes Secrets; locally --redis-url is used as given")
    return out
