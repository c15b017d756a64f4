"""`tessera up` on a pipeline-parallel resource (examples/local-tiny.yaml with PP=2, one replica): the engine
runs as two processes, a leader serving gRPC and a node, as the operator's LeaderWorkerSet runs
two pods; a greedy completion comes back through the gateway, and Ctrl-C stops all of them."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.tessera_tools.up.test_up_e2e import ROOT, Up, _alive, _children

pytestmark = pytest.mark.slow


def _greedy(up: Up) -> httpx.Response:
    return httpx.post(up.base_url + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0, "ignore_eos": True})


def test_a_pipeline_parallel_pool_runs_as_a_leader_and_a_node_process(tiny_llama, tmp_path):
    resource = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    resource["metadata"]["name"] = "local-pipeline"
    resource["spec"]["engine"]["pipelineParallelSize"] = 2
    resource["spec"]["pools"]["mixed"]["replicas"] = 1
    path = tmp_path / "local-pipeline.yaml"
    path.write_text(yaml.safe_dump(resource))
    up = Up(tiny_llama.parent, tmp_path, example=str(path))  # an absolute path replaces examples/
    try:
        up.wait_up(timeout=120)
        banner = Path(up.log.name).read_text()
        assert "engine pods: 1 mixed (each a group of 2 processes, one per pipeline stage)" in banner
        assert "mixed-0-node-1  stage 1 of 2, node of mixed-0 (no gRPC)" in banner
        engines = {pid: cmd for pid, cmd in _children(up.proc.pid).items() if "tessera_tools.cli engine" in cmd}
        ranks = sorted(re.search(r"--node-rank (\d+)", cmd).group(1) for cmd in engines.values())
        assert ranks == ["0", "1"], engines
        first, again = _greedy(up), _greedy(up)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["completion_tokens"] == 8
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]  # greedy: the same
        workers = [pid for engine in engines for pid in _children(engine)]
        assert up.stop() == 0
        assert "tessera up: stopped 3 processes" in Path(up.log.name).read_text()  # gateway, leader, node
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in [*engines, *workers]):
            time.sleep(0.1)
        assert not [pid for pid in [*engines, *workers] if _alive(pid)], "a process outlived tessera up"
    finally:
        up.stop()
