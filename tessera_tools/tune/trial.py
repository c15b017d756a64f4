"""One setting run for real: the resource with that setting written to a
file, started with `tessera up` (the gateway and engine pods as child
processes, as a user runs it), loaded at each request rate in turn with
`tessera bench serve`'s open-loop client, then stopped.

Rates go up from the lowest; the first rate whose run misses an SLO ends
the trial (higher rates only queue more). The trial's goodput is the best
goodput among the rates that held every SLO."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from tessera.child_process import ChildProcess, free_port
from tessera_tools.bench.serve.arrivals import arrival_offsets
from tessera_tools.bench.serve.client import ServeClient, Target
from tessera_tools.bench.serve.dataset import ServeRequest
from tessera_tools.bench.serve.load import run_at_rate
from tessera_tools.bench.serve.metrics import summarize
from tessera_tools.tune.knobs import with_settings
from tessera_tools.tune.search import Trial
from tessera_tools.tune.slo import SLO, misses, per_request_bounds

READY_POLL_S = 0.5


@dataclass(frozen=True)
class Workload:
    requests: list[ServeRequest]
    rates: list[float]
    """Requests per second, ascending."""
    slos: list[SLO]
    model_name: str
    """The served model's name (spec.model.name)."""
    seed: int = 0


class PlatformFailed(RuntimeError):
    """`tessera up` exited or never served: the setting cannot run here."""


class Platform:
    """`tessera up` on one resource file, until stopped."""

    def __init__(self, resource_file: Path, models_dir: str, work: Path, ready_timeout: float,
                 simulate: str | None = None) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = work / "up.log"
        self.child = ChildProcess(["up", "-f", str(resource_file), "--models-dir", models_dir,
                                   "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                                   "--log-dir", str(work / "logs"), "--no-pin",
                                   *(["--simulate", simulate] if simulate else [])], log_path=self.log_path)
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.child.proc.poll() is not None:
                raise PlatformFailed(f"tessera up exited with {self.child.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(READY_POLL_S)
        self.stop()
        raise PlatformFailed(f"tessera up did not serve within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        self.child.terminate(timeout=60)


def run_rates(base_url: str, workload: Workload) -> list[dict]:
    """Each rate's serve summary, ascending, up to the first that misses an SLO."""
    target = Target(base_url + "/v1", "completions", workload.model_name)
    bounds = per_request_bounds(workload.slos)
    percentiles = sorted({s.percentile for s in workload.slos} | {50.0, 99.0})

    async def sweep() -> list[dict]:
        results = []
        async with ServeClient(target.base_url) as client:
            # Unmeasured: the whole workload at once first. A fresh platform pays first-call costs for
            # every new batch shape; with 8 requests only, the lowest rate's p99 TPOT on the bench model
            # was 159 ms on its first run and 23 ms on the next two.
            warm = workload.requests
            await run_at_rate(client, target, warm, [0.0] * len(warm), float("inf"), None, progress=False)
            for rate in workload.rates:
                offsets = arrival_offsets(len(workload.requests), rate, seed=workload.seed)
                run = await run_at_rate(client, target, workload.requests, offsets, rate, None, progress=False)
                summary = summarize(run.outcomes, run.duration_s, percentiles, bounds or None)
                summary["request_rate"] = rate
                summary["misses"] = misses(workload.slos, summary)
                results.append(summary)
                if summary["misses"]:
                    break
        return results

    return asyncio.run(sweep())


def trial_result(settings: dict[str, int], runs: list[dict]) -> Trial:
    held = [r for r in runs if not r["misses"]]
    # Goodput needs a per-request bound (ttft, tpot, e2el); SLOs on ITL alone bound every request's throughput.
    key = "request_goodput" if held and "request_goodput" in held[0] else "request_throughput"
    goodput = max((r[key] or 0.0 for r in held), default=0.0)
    return Trial(settings, goodput, bool(held), {"rates": runs})


def run_trial(resource: dict, settings: dict[str, int], workload: Workload, models_dir: str, work: Path,
              ready_timeout: float, simulate: str | None = None) -> Trial:
    """Start the platform with `settings` (its engine pods simulated with the profile `simulate`, if
    given), load it, stop it."""
    work.mkdir(parents=True, exist_ok=True)
    resource_file = work / "inferenceservice.yaml"
    resource_file.write_text(yaml.safe_dump(with_settings(resource, settings), sort_keys=False))
    try:
        platform = Platform(resource_file, models_dir, work, ready_timeout, simulate)
    except PlatformFailed as e:
        return Trial(settings, 0.0, False, {"error": str(e)})
    try:
        return trial_result(settings, run_rates(platform.base_url, workload))
    finally:
        platform.stop()
