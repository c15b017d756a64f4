"""Start a gateway (`tessera gateway`) as a child process and wait until it routes."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from tessera.child_process import ChildProcess, free_port


def gateway_health(base_url: str, path: str = "/health") -> dict | None:
    """A gateway's /health answer ({"pods": N, ...}); None if it does not
    answer or answers 503 (no engine pod routable). ``path`` /health/ready:
    whether it takes requests (queued ones too, at zero pods)."""
    try:
        with urllib.request.urlopen(base_url + path, timeout=1) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


class GatewayProcess(ChildProcess):
    def __init__(self, config: dict, workdir: str | Path, env: dict | None = None,
                 log_path: str | Path | None = None) -> None:
        """`config` is the gateway YAML as a dict; `server` ports are chosen
        here (`server.metrics_port: 0` in `config` keeps metrics off)."""
        self.http_port = free_port()
        self.grpc_port = free_port()
        metrics_off = (config.get("server") or {}).get("metrics_port") == 0
        self.metrics_port = 0 if metrics_off else free_port()
        config = {**config, "server": {"host": "127.0.0.1", "http_port": self.http_port,
                                       "grpc_port": self.grpc_port, "metrics_port": self.metrics_port}}
        self.config_path = Path(workdir) / "gateway.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        # Prometheus text of the gateway (its own port, not the public one); None when off.
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else None
        super().__init__(["gateway", "--config", str(self.config_path), "--drain-timeout", "5"], env, log_path)

    def health(self) -> dict | None:
        return gateway_health(self.base_url)

    def wait_ready(self, num_pods: int = 1, timeout: float = 60.0) -> None:
        """Until the gateway answers and routes to at least `num_pods` pods
        (0: until it takes requests, which with admission.queue_without_pods
        it does with no pod at all)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive("gateway")
            h = self.health() if num_pods else gateway_health(self.base_url, "/health/ready")
            if h and h.get("pods", 0) >= num_pods:
                return
            time.sleep(0.1)
        raise TimeoutError(f"gateway not routing to {num_pods} pod(s) after {timeout}s")
