"""``tessera up -f FILE.yaml``: an InferenceService on this machine.

The gateway and every engine pod run as child processes on loopback ports
(see plan.py for what differs from a cluster); Redis too when the resource
names one and no --redis-url is given. A pipeline-parallel pool's engine
runs as a group of processes, one per stage, like the operator's
LeaderWorkerSet (group_plan.py), supervised as one child (child_group.py).
Ctrl-C (SIGINT) or SIGTERM drains and stops every child; a child that
crashes is restarted with back-off.

Each run generates its own internal secret (what the operator's Secret is in
a cluster), writes it to a file only this user may read, and names the file
to every child by environment: no credential is ever on a command line. A
run whose Batch API files outlive it (in spec.batch.volume's folder, or in a
Redis given by --redis-url) keeps its secret too, in the same state
directory, and the next run reuses it: the gateway signs the batch records
with a key derived from it, so a new secret would make every stored file and
batch unreadable.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import stat
import sys
import time
from pathlib import Path

import yaml
from grpc_health.v1 import health_pb2

from engine_pod.server.process import health_status
from gateway.process import gateway_health
from tessera.child_process import ChildProcess, free_port, free_port_pair
from tessera.internal_secret import SECRET_ENV, SECRET_FILE_ENV, SECRET_KEY, InternalSecret, InternalSecretError
from tessera_tools.bench.flags import positive_float
from tessera_tools.up.child_group import ChildGroup, Member
from tessera_tools.up.plan import EngineChild, LocalOptions, LocalPlan, build_plan, state_dir
from tessera_tools.up.ports import check_ports
from tessera_tools.up.supervisor import ChildFailed, Supervisor

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="run an InferenceService on this machine (gateway + engine pods)")
    p.add_argument("-f", "--file", required=True, help="InferenceService YAML (the one kubectl applies)")
    p.add_argument("--models-dir", default="models", help="local folder standing in for the model PVC")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's listen address")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=0, help="the gateway's /metrics (default: a free port)")
    p.add_argument("--tenants-file", default=None, help="tenants file (stands in for gateway.tenantsSecretRef)")
    p.add_argument("--redis-url", default=None,
                   help="Redis for kvStore.redis (default: a private redis-server is started)")
    p.add_argument("--no-pin", action="store_true", help="do not pin each engine pod to its own CPUs")
    p.add_argument("--log-dir", default=None,
                   help="child logs and what outlives a run, such as spec.batch.volume's folder "
                        "(default: .tessera/up/NAME)")
    p.add_argument("--ready-timeout", type=positive_float, default=300.0,
                   help="seconds to wait for every pod to serve")
    p.add_argument("--simulate", default=None, metavar="PROFILE",
                   help="simulate every engine pod with this step-time profile (engine_pod/sim/profiles; no model "
                        "compute, no torch): a fleet of many pods on one machine")
    p.set_defaults(func=run)


def load_resource(path: str | Path) -> dict:
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    found = [d for d in docs if isinstance(d, dict) and d.get("kind") == "InferenceService"]
    if len(found) != 1:
        raise ValueError(f"{path}: expected exactly one InferenceService document, found {len(found)}")
    return found[0]


class _StopRequested(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    resource = load_resource(args.file)
    metadata = resource.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    # An invalid name is refused by build_plan; until then it only names a folder.
    log_dir = Path(args.log_dir) if args.log_dir else None
    options = LocalOptions(models_dir=Path(args.models_dir), host=args.host, http_port=args.http_port,
                           grpc_port=args.grpc_port, metrics_port=args.metrics_port, tenants_file=args.tenants_file,
                           redis_url=args.redis_url, pin_cpus=not args.no_pin, state_dir=log_dir,
                           simulate=args.simulate)
    if options.simulate is not None and not Path(options.simulate).is_file():
        raise ValueError(f"--simulate {options.simulate}: no such step-time profile (see engine_pod/sim/profiles)")
    # Before any child starts: a taken port is a one-line error now, not a gateway that exits at every restart.
    check_ports(options.host, {"--http-port": options.http_port, "--grpc-port": options.grpc_port,
                               "--metrics-port": options.metrics_port})
    redis = None
    supervisor = Supervisor()
    if "redis" in (resource.get("spec") or {}).get("kvStore", {}) and not options.redis_url:
        redis = _start_redis(state_dir(options, name if isinstance(name, str) and name else "local"))
        options = LocalOptions(**{**options.__dict__, "redis_url": redis.url})
    try:
        plan = build_plan(resource, options, free_port, free_port_pair)
        log_dir = state_dir(options, plan.name)
        log_dir.mkdir(parents=True, exist_ok=True)
        return _serve(plan, options, log_dir, args.ready_timeout, supervisor,
                      keep_secret=batches_outlive_the_run(plan, own_redis=redis is not None))
    finally:
        stopped = supervisor.num_stopped
        if redis is not None:
            redis.stop()
            stopped += 1
        if stopped:  # the last line of every run that started something
            print(f"tessera up: stopped {stopped} process{'es' if stopped != 1 else ''}", flush=True)


def batches_outlive_the_run(plan: LocalPlan, own_redis: bool) -> bool:
    """Whether the Batch API's records outlive this run: in spec.batch.volume's folder, or in a
    Redis given by --redis-url (the run's own redis-server keeps nothing once stopped). The gateway
    signs them with a key derived from the internal secret, so such a run keeps its secret."""
    return plan.batch_directory is not None or (plan.batch and not own_redis)


def _start_redis(workdir: Path):
    from kv_store.local_redis import RedisServer

    workdir.mkdir(parents=True, exist_ok=True)
    return RedisServer(workdir)


def write_secret_file(path: Path, secret: InternalSecret) -> Path:
    """The secret in a file only this user may read (0600 from its creation, never wider)."""
    return write_private_file(path, secret.value)


def write_private_file(path: Path, data: bytes) -> Path:
    """`data` in a file only this user may read and write (0600 from its creation, never wider)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def kept_secret_file(path: Path) -> Path:
    """The secret a previous run left at `path`, if it is still this user's alone and valid; else a new
    one written there. For runs whose stored state is signed with a key derived from the secret."""
    try:
        info = path.lstat()
        private = stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
        if private and InternalSecret.load(path) is not None:
            return path
        logger.warning("up: %s is not a private file holding a valid secret; writing a new one (batch files and "
                       "batches signed with the old one are no longer readable)", path)
    except FileNotFoundError:
        pass
    except (OSError, InternalSecretError):
        logger.warning("up: %s cannot be read as an internal secret; writing a new one", path)
    return write_secret_file(path, InternalSecret.generate())


def _serve(plan: LocalPlan, options: LocalOptions, log_dir: Path, ready_timeout: float,
           supervisor: Supervisor, keep_secret: bool) -> int:
    """Runs the platform's children under `supervisor` until a signal, then stops them.
    `keep_secret`: reuse the secret the last run left (batches_outlive_the_run); else make one."""
    for warning in plan.warnings:
        logger.warning("up: %s", warning)
    secret_path = log_dir / SECRET_KEY
    secret_file = kept_secret_file(secret_path) if keep_secret else write_secret_file(secret_path,
                                                                                        InternalSecret.generate())
    # The file is each child's only secret: one inherited from this shell is blanked (an empty
    # value counts as unset), so no child holds another deployment's.
    env = {SECRET_FILE_ENV: str(secret_file), SECRET_ENV: ""}
    stop = {"requested": False}

    def on_signal(signum, frame):
        stop["requested"] = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for engine in plan.engines:
            child = _engine_child(engine, log_dir, env)
            supervisor.add(engine.name, child.start, stop_order=1, fatal_cause=child.bind_failure)
        # Private all the same, though the Batch API's Redis URL comes by environment (plan.gateway_env).
        config_path = write_private_file(log_dir / "gateway.yaml",
                                         yaml.safe_dump(plan.gateway_config, sort_keys=False).encode())
        gateway = _LoggedChild(["gateway", "--config", str(config_path)], log_dir / "gateway.log",
                               {**env, **plan.gateway_env})
        supervisor.add("gateway", gateway.start, stop_order=0, fatal_cause=gateway.bind_failure)
        _wait_ready(plan, options, supervisor, stop, ready_timeout)
        print(banner(plan, options, log_dir), flush=True)
        while not stop["requested"]:
            supervisor.check()
            time.sleep(0.2)
        print("tessera up: stopping (draining in-flight requests)...", flush=True)
        return 0
    except _StopRequested:
        print("tessera up: stopped before the platform was ready", flush=True)
        return 130
    except ChildFailed as e:
        print(f"tessera up: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        supervisor.stop()
        if not keep_secret:
            secret_file.unlink(missing_ok=True)  # the next run makes its own
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _engine_child(engine: EngineChild, log_dir: Path, env: dict[str, str]) -> _LoggedChild | ChildGroup:
    """One engine pod's process, or a pipeline-parallel engine's group (leader and nodes, each
    logging to its own file), which the supervisor starts, watches and restarts as one. `env`: every
    child's; the engine's own (the Redis URL) goes to the engine core alone, the leader, as the
    operator's worker pods get none."""
    leader = _LoggedChild(engine.args, log_dir / f"{engine.name}.log", {**env, **engine.env}, engine.cpus)
    if not engine.nodes:
        return leader
    nodes = [Member(f"node {node.node_rank} ({node.name})", _LoggedChild(node.args, log_dir / f"{node.name}.log", env,
                                                                          node.cpus))
             for node in engine.nodes]
    return ChildGroup(engine.name, [Member("leader", leader), *nodes])


# What a child logs when it cannot bind a port (uvicorn, prometheus_client, the servers' own
# "cannot listen on" errors): no restart helps, the port stays taken.
_BIND_FAILURE = re.compile(r"address already in use|cannot listen on", re.IGNORECASE)


class _LoggedChild:
    """Starts one child, logging to its file, and tells from the file why the last start exited."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str], cpus: frozenset[int] | None = None):
        self.args, self.log_path, self.env, self.cpus = args, log_path, env, cpus
        self._log_start = 0

    def start(self) -> ChildProcess:
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        return ChildProcess(self.args, env=self.env, log_path=self.log_path, cpus=self.cpus)

    def bind_failure(self) -> str | None:
        """The line of this start's log that says a port could not be bound, or None."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        found = [line.strip() for line in lines if _BIND_FAILURE.search(line)]
        return f"{found[-1][:300]} (log: {self.log_path})" if found else None


def _wait_ready(plan: LocalPlan, options: LocalOptions, supervisor: Supervisor, stop: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = {e.name: e for e in plan.engines}
    while time.monotonic() < deadline:
        if stop["requested"]:
            raise _StopRequested()
        supervisor.check()
        for name, engine in list(waiting.items()):
            if health_status(engine.address, timeout=0.5) == health_pb2.HealthCheckResponse.SERVING:
                del waiting[name]
        if not waiting and _gateway_pods(options) >= len(plan.engines):
            return
        time.sleep(0.2)
    raise TimeoutError(f"tessera up: not ready after {timeout:.0f} s (waiting for {sorted(waiting) or 'gateway'}); "
                       "see the logs")


def _gateway_pods(options: LocalOptions) -> int:
    health = gateway_health(f"http://{_client_host(options)}:{options.http_port}")
    return (health or {}).get("pods", 0)


def _client_host(options: LocalOptions) -> str:
    return "127.0.0.1" if options.host in ("0.0.0.0", "::") else options.host


def _engine_lines(engine: EngineChild, width: int) -> list[str]:
    """The pod's line; a pipeline-parallel group's leader says so, and each of its nodes gets a line."""
    line = f"  {engine.name:<{width}}  gRPC {engine.address}  metrics http://127.0.0.1:{engine.metrics_port}/metrics"
    line += f"  KV inbox 127.0.0.1:{engine.kv_inbox_port}" if engine.kv_inbox_port else ""
    if not engine.nodes:
        return [line]
    size = len(engine.nodes) + 1
    line += f"  (leader, stage 0 of {size}; the group meets at 127.0.0.1:{engine.master_port})"
    return [line] + [f"  {node.name:<{width}}  stage {node.node_rank} of {size}, node of {engine.name} (no gRPC)"
                     for node in engine.nodes]


def _group_note(plan: LocalPlan, role: str) -> str:
    """" (each a group of P processes, one per pipeline stage)" for a pipeline-parallel pool, else ""."""
    sizes = {len(e.nodes) + 1 for e in plan.engines if e.role == role}
    return f" (each a group of {sizes.pop()} processes, one per pipeline stage)" if sizes != {1} else ""


def banner(plan: LocalPlan, options: LocalOptions, log_dir: Path) -> str:
    host = _client_host(options)
    base = f"http://{host}:{options.http_port}"
    roles = ", ".join(f"{sum(e.role == r for e in plan.engines)} {r}" + _group_note(plan, r)
                      for r in dict.fromkeys(e.role for e in plan.engines))
    key = "YOUR_API_KEY" if options.tenants_file else "local"
    width = max(len(name) for e in plan.engines for name in (e.name, *(n.name for n in e.nodes)))
    engines = "\n".join(line for e in plan.engines for line in _engine_lines(e, width))
    batch = ""
    if plan.batch:
        kept = f"kept in {plan.batch_directory}" if plan.batch_directory else "kept in kvStore.redis's Redis"
        batch = f"  batch    {base}/v1/files, {base}/v1/batches      (the Batch API; {kept})\n"
    return f"""
Tessera is up: InferenceService {plan.name!r}, model {plan.model_name!r}, engine pods: {roles}
  REST     {base}/v1      (OpenAPI {base}/openapi.json)
  gRPC     {host}:{options.grpc_port}      (tessera.v1.Inference, health, reflection)
  metrics  http://{host}:{plan.metrics_port}/metrics      (the gateway's; not on the public port)
{batch}{engines}
  logs     {log_dir}

curl {base}/v1/completions -H 'Content-Type: application/json' -H 'Authorization: Bearer {key}' \\
  -d '{{"model": "{plan.model_name}", "prompt": "Hello, my name is", "max_tokens": 16}}'

python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{key}")
print(client.completions.create(model="{plan.model_name}", prompt="Hello, my name is", max_tokens=16).choices[0].text)
PY

Ctrl-C drains and stops everything.
"""
