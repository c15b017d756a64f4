"""`tessera bench serve` end to end: the command as a subprocess against a
real gateway and one tiny engine pod, a two-rate sweep, JSON and plots."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tessera_tools.bench.serve.dataset import synthetic_requests
from tessera.text import load_tokenizer
from tests.conftest import checkpoint
from tests.gateway.conftest import MAX_MODEL_LEN, MODEL_NAME, gateway_config

# One torch thread: the pod shares this machine's cores with the gateway and the client.
POD_ARGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(32 << 20),
            "--cpu-threads", "1"]
METRICS = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std",
                                                                                         "p50", "p99")]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-bench")
    model = checkpoint("tiny")
    with EnginePodProcess(model, POD_ARGS, log_path=work / "pod.log") as pod:
        pod.wait_serving()
        with GatewayProcess(gateway_config(model, [(pod, "mixed")]), work, log_path=work / "gateway.log") as gw:
            gw.wait_ready(num_pods=1)
            yield gw


def test_sweep_writes_json_and_plots(gateway, tmp_path):
    out, plots = tmp_path / "serve.json", tmp_path / "plots"
    cmd = [sys.executable, "-m", "tessera_tools.cli", "bench", "serve", "--base-url", gateway.base_url + "/v1",
           "--tokenizer", str(checkpoint("tiny")), "--num-prompts", "8", "--max-prompt-len", "48",
           "--max-output-len", "8", "--prefix-groups", "2", "--prefix-len", "16", "--request-rates", "8,inf",
           "--goodput", "ttft:10000", "tpot:5000", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--output-json", str(out), "--plot-dir", str(plots)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

    tokenizer = load_tokenizer(checkpoint("tiny"))
    dataset = synthetic_requests(tokenizer, 8, max_prompt_len=48, max_output_len=8, seed=0)
    report = json.loads(out.read_text())
    assert report["model"] == MODEL_NAME and report["ignore_eos"] is True
    assert [run["request_rate"] for run in report["runs"]] == [8.0, "inf"]
    for run in report["runs"]:
        assert (run["completed"], run["failed"]) == (8, 0), run["errors"]
        for key in METRICS + ["request_throughput", "output_throughput", "total_token_throughput",
                              "request_goodput", "duration_s"]:
            assert isinstance(run[key], float) and run[key] >= 0, key
        # Generous SLOs: every request meets them.
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])
        requests = run["requests"]
        assert len(requests) == 8
        # ignore_eos holds every output to its drawn length (the dataset is seeded).
        assert [r["output_tokens"] for r in requests] == [r.output_len for r in dataset]
        assert all(r["error"] is None and r["ttft_ms"] > 0 for r in requests)
    for name in ("latency_vs_throughput.png", "ttft_distribution.png", "itl_distribution.png"):
        png = plots / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
    assert "| inf |" in done.stdout  # the sweep table
