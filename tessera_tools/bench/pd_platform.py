"""The set-ups `tessera bench pd` compares, each a gateway in front of two
engine pods of its own: started together, stopped together (also on an
error or Ctrl-C), and read through the pods' Prometheus counters.

- mixed: two mixed pods, no disaggregation;
- redis: a prefill pod and a decode pod sharing a private Redis, the
  gateway's kv_channel "redis";
- direct: the same, the decode pod with an inbox and its socket
  (--kv-inbox-port), kv_channel "direct" (Redis stays the fallback, so both
  pods still name it);
- direct-grpc: direct without the inbox socket: pushes over the
  PushKVBlocks gRPC stream (what the socket saves).

Each P/D set-up has a Redis of its own: a prefill pod finds a prompt's
blocks in Redis, so two set-ups sharing one would read each other's
prompts instead of computing them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from kv_store.local_redis import RedisServer
from tessera.child_process import ChildProcess, free_port
from tessera_tools.bench.fleet.measure import scrape

MODEL_NAME = "bench"
MODES = ("mixed", "redis", "direct", "direct-grpc")

# Pod counters the report reads; "key/label" keeps one key per value of that label.
POD_SAMPLES = {
    "tessera_kv_transfer_bytes_total": "transfer_bytes/channel",
    "tessera_kv_transfer_seconds_total": "transfer_seconds/channel",
    "tessera_kv_transfer_pushes_total": "pushes/outcome",
    "tessera_kv_transfer_push_paths_total": "push_paths/path",
    "tessera_kv_store_hits_total": "store_hits/tier",
    "tessera_kv_store_lookups_total": "store_lookups",
    "tessera_kv_store_load_seconds_sum": "store_load_seconds",
    "tessera_kv_store_load_seconds_count": "store_loads",
    "tessera_prefix_cache_hits_total": "prefix_hit_tokens",
    "tessera_prefix_cache_queries_total": "prefix_query_tokens",
    "tessera_time_to_first_token_seconds_sum": "pod_ttft_seconds",
    "tessera_time_to_first_token_seconds_count": "pod_requests",
    "tessera_e2e_request_latency_seconds_sum": "pod_e2e_seconds",
}


@dataclass(frozen=True)
class PodSettings:
    """What every pod of every set-up runs with (one TP degree at a time)."""

    model: Path
    dtype: str
    tp: int
    # Torch threads per TP rank: a pod gets tp times this many.
    threads_per_rank: int
    kv_cache_bytes: int
    # The decode pod's budget for pushed blocks in the direct set-up.
    inbox_bytes: int
    # None: the engine's default.
    max_num_batched_tokens: int | None
    # A step-time profile: simulated pods (no model computed); None: real ones.
    simulate: str | None = None
    # Each set-up's private Redis holds at most this many bytes (least recently used out).
    redis_bytes: int = 4 << 30
    # The pods' Redis socket timeout (--kv-redis-timeout); None: the engine's default.
    redis_timeout_s: float | None = None

    def args(self) -> list[str]:
        # A stop is a benchmark's end: nothing in flight is worth waiting long for.
        args = ["--kv-cache-memory-bytes", str(self.kv_cache_bytes), "--drain-timeout", "5"]
        if self.redis_timeout_s is not None:
            args += ["--kv-redis-timeout", str(self.redis_timeout_s)]
        if self.simulate is not None:
            args += ["--simulate", self.simulate]
        else:
            args += ["--dtype", self.dtype, "--tensor-parallel-size", str(self.tp),
                     "--cpu-threads", str(self.tp * self.threads_per_rank)]
        if self.max_num_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return args


@dataclass
class Platform:
    """One set-up: its gateway and its pods by role."""

    # mixed, redis or direct.
    mode: str
    gateway: GatewayProcess
    # "mixed": [two pods]; P/D: "prefill": [one], "decode": [one].
    pods: dict[str, list[EnginePodProcess]]

    @property
    def api_root(self) -> str:
        return self.gateway.base_url + "/v1"

    def counters(self) -> dict[str, dict[str, float]]:
        """Each role's pod counters now, summed over its pods."""
        out: dict[str, dict[str, float]] = {}
        for role, pods in self.pods.items():
            total: dict[str, float] = {}
            for pod in pods:
                for key, value in scrape(f"http://127.0.0.1:{pod.metrics_port}/metrics", POD_SAMPLES).items():
                    total[key] = total.get(key, 0.0) + value
            out[role] = total
        return out


def counter_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """What each role's counters grew by between two `Platform.counters` reads."""
    return {role: {key: value - before[role].get(key, 0.0) for key, value in sorted(now.items())}
            for role, now in after.items()}


def channel(mode: str) -> str:
    """The gateway's kv_channel of a P/D set-up."""
    return "direct" if mode.startswith("direct") else mode


def _pod_roles(mode: str) -> list[tuple[str, str]]:
    """(log name, role) of a set-up's pods: the same count in every set-up."""
    if mode == "mixed":
        return [("mixed-a", "mixed"), ("mixed-b", "mixed")]
    return [("prefill", "prefill"), ("decode", "decode")]


def _gateway_config(mode: str, model: Path, pods: list[tuple[EnginePodProcess, str]],
                    min_uncached_tokens: int) -> dict:
    config: dict = {
        "model": {"name": MODEL_NAME, "path": str(model)},
        "pods": {"static": [{"address": pod.address, "role": role} for pod, role in pods]},
        # Fresh load reports: the mixed set-up spreads concurrent requests by load.
        "router": {"load_interval_ms": 50},
    }
    if mode != "mixed":
        config["disaggregation"] = {"min_uncached_tokens": min_uncached_tokens, "kv_channel": channel(mode)}
    return config


def _stop(children: list[ChildProcess]) -> None:
    """SIGTERM every child at once, then wait for each: the pods drain side
    by side instead of one after another."""
    for child in children:
        child.request_stop()
    for child in children:
        child.terminate()


@contextlib.contextmanager
def platforms(modes: list[str], pods: PodSettings, min_uncached_tokens: int, work: Path,
              start_timeout_s: float = 600.0) -> Iterator[dict[str, Platform]]:
    """Every set-up of `modes` running, logs under `work/<mode>/`; all of it
    stopped on the way out, whatever the way. Start everything from the main
    thread: a Redis and a pod die with the thread that started them."""
    children: list[ChildProcess] = []
    redis_servers: list[RedisServer] = []
    try:
        started: dict[str, list[tuple[EnginePodProcess, str]]] = {}
        for mode in modes:
            folder = work / mode
            folder.mkdir(parents=True, exist_ok=True)
            extra = []
            if mode != "mixed":
                redis_servers.append(RedisServer(folder, maxmemory=pods.redis_bytes))
                extra = ["--kv-redis-url", redis_servers[-1].url]
            started[mode] = []
            # All pods start before any is waited for: they load the model side by side.
            for name, role in _pod_roles(mode):
                args = [*pods.args(), *extra, "--role", role]
                if channel(mode) == "direct" and role == "decode":
                    args += ["--kv-inbox-bytes", str(pods.inbox_bytes)]
                    if mode == "direct":
                        args += ["--kv-inbox-port", str(free_port())]
                pod = EnginePodProcess(pods.model, args, log_path=folder / f"{name}.log")
                children.append(pod)
                started[mode].append((pod, role))
        for mode_pods in started.values():
            for pod, _ in mode_pods:
                pod.wait_serving(timeout=start_timeout_s)
        out = {}
        for mode, mode_pods in started.items():
            config = _gateway_config(mode, pods.model, mode_pods, min_uncached_tokens)
            gateway = GatewayProcess(config, work / mode, log_path=work / mode / "gateway.log")
            children.append(gateway)
            by_role: dict[str, list[EnginePodProcess]] = {}
            for pod, role in mode_pods:
                by_role.setdefault(role, []).append(pod)
            out[mode] = Platform(mode, gateway, by_role)
        for platform in out.values():
            platform.gateway.wait_ready(num_pods=2)
        yield out
    finally:
        _stop(children)
        for redis in redis_servers:  # after the pods: none of them loses its store while draining
            redis.stop()
