"""Start and stop one run's fleet: simulated engine pods, several processes
of them, and the gateway replicas in front of them, all fresh (every run
starts cold).

Each simulated-pods process takes a random range of consecutive ports that
are free when it is chosen but bound only once the child starts: ranges
chosen back to back may overlap, so a process whose range overlaps an
earlier one's is replaced before it binds, and one that dies at start-up
(a port taken meanwhile by someone else) is started again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from engine_pod.server.process import SimulatedPodsProcess
from gateway.process import GatewayProcess
from gateway.tenants import hash_api_key

MODEL_NAME = "fleet"
START_ATTEMPTS = 3


@dataclass(frozen=True)
class FleetSettings:
    """What every run's pods and gateways share."""

    model: Path
    """Checkpoint folder: simulated pods and gateways read its config and tokenizer (no weights)."""
    profile: Path
    """The pods' step-time profile (JSON)."""
    pods_per_process: int
    """Simulated pods per `tessera engine` process."""
    kv_blocks: int
    """Each pod's KV pool, in blocks (--num-gpu-blocks)."""
    block_size: int
    """Tokens per block, pods and gateways alike."""
    max_model_len: int
    """The context limit of pods and gateways (a pod's pool must hold one whole sequence)."""
    tenants_file: Path
    """The gateways' tenants file (one API key per tenant)."""


def process_sizes(num_pods: int, per_process: int) -> list[int]:
    """Pods per process, as even as possible: 40 at 16 a process -> 14, 13, 13."""
    count = -(-num_pods // per_process)
    return [num_pods // count + (i < num_pods % count) for i in range(count)]


def tenant_keys(num_tenants: int) -> list[str]:
    return [f"sk-fleet-tenant-{i:04d}" for i in range(num_tenants)]


def tenant_name(index: int) -> str:
    return f"tenant-{index:04d}"


def write_tenants_file(path: Path, keys: list[str]) -> Path:
    entries = [{"name": tenant_name(i), "api_key_sha256": [hash_api_key(key)]} for i, key in enumerate(keys)]
    path.write_text(yaml.safe_dump({"tenants": entries}))
    return path


@dataclass
class Fleet:
    """One run's processes, and how long they took to come up."""

    pods: list[SimulatedPodsProcess] = field(default_factory=list)
    gateways: list[GatewayProcess] = field(default_factory=list)
    pods_start_s: float = 0.0
    gateways_start_s: float = 0.0

    @property
    def addresses(self) -> list[str]:
        return [a for p in self.pods for a in p.addresses]

    @property
    def pod_metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}/metrics" for p in self.pods for port in p.metrics_ports]


def _ports(process: SimulatedPodsProcess) -> set[int]:
    return {*process.grpc_ports, *process.metrics_ports}


def _launch(settings: FleetSettings, size: int, log: Path, taken: set[int]) -> SimulatedPodsProcess:
    args = ["--num-gpu-blocks", str(settings.kv_blocks), "--block-size", str(settings.block_size),
            "--max-model-len", str(settings.max_model_len), "--drain-timeout", "1"]
    while True:
        process = SimulatedPodsProcess(settings.model, settings.profile, size, args, log_path=log)
        if not _ports(process) & taken:
            return process
        process.proc.kill()
        process.terminate()


def _start_pods(fleet: Fleet, settings: FleetSettings, num_pods: int, run_dir: Path) -> None:
    sizes = process_sizes(num_pods, settings.pods_per_process)
    taken: set[int] = set()
    for i, size in enumerate(sizes):
        process = _launch(settings, size, run_dir / f"pods{i}.log", taken)
        taken |= _ports(process)
        fleet.pods.append(process)
    for i, size in enumerate(sizes):
        for attempt in range(START_ATTEMPTS):
            try:
                fleet.pods[i].wait_serving(timeout=60 + size)
                break
            except RuntimeError as e:  # it exited: a port of its range was taken after it was chosen?
                if attempt == START_ATTEMPTS - 1:
                    raise RuntimeError(f"{e}: {_last_line(fleet.pods[i].log_path)}") from None
                fleet.pods[i].terminate()
                taken -= _ports(fleet.pods[i])
                fleet.pods[i] = _launch(settings, size, run_dir / f"pods{i}.log", taken)
                taken |= _ports(fleet.pods[i])


def _last_line(log: Path | None) -> str:
    lines = log.read_text(errors="replace").strip().splitlines() if log and log.is_file() else []
    return lines[-1] if lines else "(no log)"


def gateway_config(settings: FleetSettings, addresses: list[str], router: dict) -> dict:
    return {
        "model": {"name": MODEL_NAME, "path": str(settings.model), "block_size": settings.block_size,
                  "max_model_len": settings.max_model_len},
        "pods": {"static": [{"address": a, "role": "mixed"} for a in addresses]},
        "router": router,
        "tenants_file": str(settings.tenants_file),
    }


def _start_gateways(fleet: Fleet, settings: FleetSettings, count: int, router: dict, run_dir: Path) -> None:
    config = gateway_config(settings, fleet.addresses, router)
    for i in range(count):
        work = run_dir / f"gateway{i}"
        work.mkdir(parents=True, exist_ok=True)
        fleet.gateways.append(GatewayProcess(config, work, log_path=work / "gateway.log"))
    for gw in fleet.gateways:
        gw.wait_ready(num_pods=len(fleet.addresses), timeout=60 + len(fleet.addresses) / 2)


def _stop(fleet: Fleet) -> None:
    """Gateways first (nothing then reaches the pods), each group signalled
    at once and then awaited, so their drains overlap."""
    for group in (fleet.gateways, fleet.pods):
        for process in group:
            process.request_stop()
        for process in group:
            process.terminate()


@contextlib.contextmanager
def running_fleet(settings: FleetSettings, num_pods: int, num_gateways: int, router: dict,
                  run_dir: Path) -> Iterator[Fleet]:
    """Fresh pods and gateways for one run, stopped afterwards whatever happens."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet()
    try:
        start = time.monotonic()
        _start_pods(fleet, settings, num_pods, run_dir)
        fleet.pods_start_s = time.monotonic() - start
        start = time.monotonic()
        _start_gateways(fleet, settings, num_gateways, router, run_dir)
        fleet.gateways_start_s = time.monotonic() - start
        yield fleet
    finally:
        _stop(fleet)
