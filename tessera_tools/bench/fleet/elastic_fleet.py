"""The processes of a fleet whose pods come and go: one simulated pod per
process (each pod has its own lifecycle), and gateways that take their
pods from the pods file (`pods.file`), as gateways in a cluster take them
from the pool Service's EndpointSlices."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from engine_pod.server.process import SimulatedPodsProcess, health_status
from gateway.process import GatewayProcess
from grpc_health.v1 import health_pb2
from tessera_tools.bench.fleet.fleet import MODEL_NAME, FleetSettings

# Seconds between the gateways' looks at the pods file; a pod's SIGTERM
# waits REMOVAL_GRACE_POLLS of them after it left the file.
FILE_POLL_S = 0.2
REMOVAL_GRACE_POLLS = 3
# In-flight requests a terminating pod may finish (Kubernetes' default grace period).
DRAIN_TIMEOUT_S = 30.0
# Seconds a request may wait in a gateway's queue beyond the start-up of a pod.
QUEUE_TIMEOUT_MARGIN_S = 60.0


def fetch_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class SimulatedPod:
    """A one-pod `tessera engine --simulate` process (elastic_pool.PodHandle)."""

    def __init__(self, settings: FleetSettings, log_path: Path, extra_args: list[str] = ()) -> None:
        """`extra_args`: the pool's own flags (a P/D pod's role and KV store: pd_store.pod_args)."""
        args = ["--num-gpu-blocks", str(settings.kv_blocks), "--block-size", str(settings.block_size),
                "--max-model-len", str(settings.max_model_len), "--drain-timeout", str(DRAIN_TIMEOUT_S),
                *extra_args]
        self.process = SimulatedPodsProcess(settings.model, settings.profile, 1, args, log_path=log_path)
        self.address = self.process.addresses[0]
        self.metrics_url = f"http://127.0.0.1:{self.process.metrics_ports[0]}/metrics"

    def serving(self) -> bool:
        return health_status(self.address, timeout=0.5) == health_pb2.HealthCheckResponse.SERVING

    def request_stop(self) -> None:
        self.process.request_stop()

    def exit_code(self) -> int | None:
        return self.process.proc.poll()

    def close(self) -> None:
        self.process.terminate(timeout=DRAIN_TIMEOUT_S + 10)

    def rss_bytes(self) -> int | None:
        """Resident memory of the live process (None once it has exited)."""
        try:
            with open(f"/proc/{self.process.proc.pid}/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return None


def pod_launcher(settings: FleetSettings, log_dir: Path, extra_args: list[str] = ()) -> Callable[[str], SimulatedPod]:
    return lambda name: SimulatedPod(settings, log_dir / f"{name}.log", extra_args)


def file_gateway_config(settings: FleetSettings, pods_path: Path, router: dict, queue_without_pods: bool,
                        queue_timeout_s: float) -> dict:
    return {
        "model": {"name": MODEL_NAME, "path": str(settings.model), "block_size": settings.block_size,
                  "max_model_len": settings.max_model_len},
        "pods": {"file": {"path": str(pods_path), "poll_interval_s": FILE_POLL_S}},
        "router": router,
        "admission": {"queue_without_pods": queue_without_pods, "queue_timeout_s": queue_timeout_s},
        "tenants_file": str(settings.tenants_file),
    }


@contextlib.contextmanager
def running_gateways(config: dict, count: int, run_dir: Path) -> Iterator[list[GatewayProcess]]:
    """`count` gateways on `config`, started at once; stopped (drained together) afterwards."""
    gateways: list[GatewayProcess] = []
    try:
        for i in range(count):
            work = run_dir / f"gateway{i}"
            work.mkdir(parents=True, exist_ok=True)
            gateways.append(GatewayProcess(config, work, log_path=work / "gateway.log"))
        yield gateways
    finally:
        for gw in gateways:
            gw.request_stop()
        for gw in gateways:
            gw.terminate()
