"""Monitoring end to end: `tessera up` (a real subprocess: gateway, one engine pod with a host
and a Redis KV tier and a LoRA adapter, Redis) serves traffic; its scrapes pass
`promtool check metrics`, and a real Prometheus scraping the addresses `up` printed answers
every query of every panel of the chart's dashboards with data."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.tenants import hash_api_key
from tessera.child_process import free_port
from tests.test_metrics_doc import documented_metrics, served_metrics

ROOT = Path(__file__).resolve().parents[3]
DASHBOARDS = sorted((ROOT / "charts" / "tessera" / "dashboards").glob("*.json"))
KEY = "sk-monitoring-test"
# What Grafana substitutes into a panel's query: every template variable at "All".
VARIABLES = {"$__rate_interval": "1m", "$tenant": ".*", "$priority_class": ".*", "$model_name": ".*",
             "$instance": ".*"}


@dataclass
class Platform:
    proc: subprocess.Popen
    output: Path
    base_url: str
    gateway_metrics: str       # host:port
    engine_metrics: list[str]  # host:port of each pod


def _resource(models_dir: Path, adapter: Path) -> dict:
    return {
        "apiVersion": "tessera.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "monitored", "namespace": "default"},
        "spec": {
            "model": {"name": "tiny", "pvc": {"claimName": "models", "path": models_dir.name}, "dtype": "float32"},
            "mode": "mixed",
            "engine": {"maxNumBatchedTokens": 1024, "maxNumSeqs": 8},
            "pools": {"mixed": {"replicas": 1}},
            "loras": [{"name": "sql", "hostPath": {"path": str(adapter)}}],
            "kvStore": {"hostMemory": "64Mi", "redis": {"urlSecretRef": {"name": "redis", "key": "url"}}},
        },
    }


def _wait_for(output: Path, proc: subprocess.Popen, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = output.read_text()
        assert proc.poll() is None, content
        if text in content:
            return content
        time.sleep(0.2)
    raise TimeoutError(output.read_text())


def _send_traffic(base_url: str) -> None:
    """Requests that make every collector emit: plain, guided, on the adapter, and a refused one."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for body in ({"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 4},
                     {"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 4},
                     {"model": "sql", "prompt": "SELECT", "max_tokens": 3}):
            r = client.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 200, r.text
        r = client.post("/v1/chat/completions", headers=auth, json={
            "model": "tiny", "messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 4,
            "structured_outputs": {"choice": ["yes", "no"]}})
        assert r.status_code == 200, r.text
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                        headers={"Authorization": "Bearer sk-wrong"})
        assert r.status_code == 401, r.text


@pytest.fixture(scope="module")
def platform(tiny_llama, tiny_llama_loras, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitoring")
    resource = tmp / "monitored.yaml"
    resource.write_text(yaml.safe_dump(_resource(tiny_llama, tiny_llama_loras[0])))
    tenants = tmp / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [{"name": "acme", "api_key_sha256": [hash_api_key(KEY)]}]}))
    http_port = free_port()
    output = tmp / "up.out"
    with open(output, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tessera_tools.cli", "up", "-f", str(resource), "--models-dir",
             str(tiny_llama.parent), "--http-port", str(http_port), "--grpc-port", str(free_port()),
             "--tenants-file", str(tenants), "--log-dir", str(tmp / "logs")],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        banner = _wait_for(output, proc, "Tessera is up", timeout=240)
        # The addresses as `up` printed them: the gateway's metrics and each pod's.
        gateway = re.search(r"^  metrics  http://(\S+)/metrics", banner, re.M).group(1)
        engines = re.findall(r"^  mixed-\d+\s+gRPC \S+  metrics http://(\S+)/metrics", banner, re.M)
        assert len(engines) == 1, banner
        base_url = f"http://127.0.0.1:{http_port}"
        _send_traffic(base_url)
        yield Platform(proc, output, base_url, gateway, engines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _promtool_check(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian/Ubuntu: apt-get install prometheus)")
def test_every_scrape_passes_promtool_without_created_series_and_with_process_metrics(platform):
    doc = documented_metrics()
    sections = {platform.gateway_metrics: "Gateway", platform.engine_metrics[0]: "Engine pods"}
    for address, section in sections.items():
        text = httpx.get(f"http://{address}/metrics", timeout=10).text
        checked = _promtool_check(text)
        assert checked.returncode == 0, f"{section}: {checked.stdout}{checked.stderr}"
        assert not re.search(r"^\w+_created[{ ]", text, re.M), section
        served = served_metrics(text)
        for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                     "process_start_time_seconds", "python_info"):
            assert name in served, (section, name)
        # Every family of a real scrape is on docs/metrics.md, under the component's section.
        assert set(served) <= set(doc[section]) | set(doc["Every process"]), set(served) - set(doc[section])
    engine = served_metrics(httpx.get(f"http://{platform.engine_metrics[0]}/metrics", timeout=10).text)
    # Every collector emitted: KV store (with Redis), guided decoding, LoRA, in-flight.
    for name in ("tessera_kv_store_redis_up", "tessera_kv_store_rejected_values_total",
                 "tessera_structured_output_requests_total", "tessera_lora_requests_total",
                 "tessera_lora_adapter_resident", "tessera_request_in_flight_seconds_total"):
        assert name in engine, name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_check_refuses_a_counter_without_total():
    """The check has teeth: a counter family promtool flags fails it."""
    bad = "# HELP tessera_bad A counter\n# TYPE tessera_bad counter\ntessera_bad 1.0\n"
    assert _promtool_check(bad).returncode != 0


def _panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, PromQL with the variables substituted) of every panel target."""
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for name, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
                    expr = expr.replace(name, value)
                assert "$" not in expr, (path.name, panel["title"], expr)
                out.append((path.stem, panel["title"], expr))
    return out


def _variable_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard, variable, selector, label) of each `label_values(SELECTOR, LABEL)` variable."""
    out = []
    for path in DASHBOARDS:
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] == "query":
                selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"]).groups()
                for name, value in VARIABLES.items():
                    selector = selector.replace(name, value)
                out.append((path.stem, var["name"], selector, label))
    return out


@pytest.fixture
def prometheus(platform, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian/Ubuntu: apt-get install prometheus)")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "tessera-gateway", "static_configs": [{"targets": [platform.gateway_metrics]}]},
            {"job_name": "tessera-engine", "static_configs": [{"targets": platform.engine_metrics}]},
        ],
    }))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _query(url: str, expr: str) -> dict:
    return httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()


def test_every_dashboard_query_returns_data_from_a_real_prometheus(platform, prometheus):
    panels, variables = _panel_queries(), _variable_queries()
    assert len(panels) > 40
    # Parse errors fail at once; an empty answer may only mean too few scrapes yet.
    deadline = time.monotonic() + 60
    while True:
        targets = [t["health"] for t in httpx.get(f"{prometheus}/api/v1/targets", timeout=10)
                   .json()["data"]["activeTargets"]]
        empty = []
        for dashboard, title, expr in panels:
            answer = _query(prometheus, expr)
            assert answer["status"] == "success", (dashboard, title, expr, answer)
            if not answer["data"]["result"]:
                empty.append((dashboard, title, expr))
        for dashboard, name, selector, label in variables:
            answer = _query(prometheus, selector)
            assert answer["status"] == "success", (dashboard, name, selector, answer)
            if not any(label in s["metric"] for s in answer["data"]["result"]):
                empty.append((dashboard, f"variable {name}", selector))
        if not empty and targets == ["up"] * 2:
            return
        assert time.monotonic() < deadline, f"targets {targets}; queries without data: {empty}"
        time.sleep(1)
