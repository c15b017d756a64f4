"""A PP=2 engine pod's Prometheus metrics: each stage's steps, busy and wait
seconds (read from the workers' shared board at scrape time, while steps
are in flight), and the engine's steps in flight."""

from __future__ import annotations

import asyncio

import pytest

from engine_pod.server.process import EnginePodProcess
from tests.engine_pod.server.client import generate_all, greedy, scrape_metrics
from tests.engine_pod.server.conftest import POD_ARGS

pytestmark = pytest.mark.slow  # worker processes


def test_each_stage_reports_its_steps_and_where_their_time_went(tiny_llama, tmp_path):
    args = [*POD_ARGS, "--pipeline-parallel-size", "2", "--cpu-threads", "2"]
    with EnginePodProcess(tiny_llama, args, log_path=tmp_path / "pod.log") as pod:
        pod.wait_serving()
        before = scrape_metrics(pod)
        requests = [greedy(list(range(10 + i, 60 + i)), 12) for i in range(6)]
        results = asyncio.run(generate_all(pod.address, requests))
        after = scrape_metrics(pod)
    assert all(len(tokens) == 12 for tokens, _ in results)
    for stage in ("0", "1"):
        labels = (("stage", stage),)
        steps = after[("tessera_pipeline_stage_steps_total", labels)] - before.get(
            ("tessera_pipeline_stage_steps_total", labels), 0.0)
        busy = after[("tessera_pipeline_stage_busy_seconds_total", labels)]
        wait = after[("tessera_pipeline_stage_wait_seconds_total", labels)]
        # Six 50-token prompts and 11 more steps each: at least the 11 decode steps ran on every stage.
        assert steps >= 11, (stage, steps)
        assert busy > 0.0 and 0.0 < wait < busy + wait  # each hands over to the other, and computes
    assert ("tessera_steps_in_flight", ()) in after
