"""An engine pod with --tensor-parallel-size 2: serves the same greedy
tokens as the offline TP=1 engine, and leaves no worker behind on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from grpc_health.v1 import health_pb2

from engine_pod import LLM, SamplingParams
from engine_pod.server.process import EnginePodProcess, health_status
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.engine_pod.server.client import generate_all, greedy, load, pod_channel
from tests.engine_pod.server.conftest import POD_ARGS


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return found


def test_tp2_pod_serves_offline_tokens_and_stops_its_workers(tiny_llama, tmp_path):
    prompts = [[11, 12, 13], list(range(100, 160)), [7] * 20]
    max_tokens = [16, 9, 20]
    with LLM(str(tiny_llama), dtype="float64", max_model_len=256, kv_cache_memory_bytes=32 << 20) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens])
    expected = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    args = [*POD_ARGS, "--tensor-parallel-size", "2", "--cpu-threads", "2"]
    with EnginePodProcess(tiny_llama, args, log_path=tmp_path / "pod.log") as pod:
        pod.wait_serving()
        got = asyncio.run(generate_all(pod.address, [greedy(p, n) for p, n in zip(prompts, max_tokens)]))
        # Workers are the pod's children (the multiprocessing resource tracker is one too).
        workers = _children(pod.proc.pid)
        assert len(workers) >= 2
        assert pod.terminate() == 0
    assert got == expected
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{p}") for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")]


def test_a_wedged_step_is_reported_stalled_and_the_pod_recovers(tiny_llama, tmp_path):
    """A stopped tensor-parallel worker wedges the engine loop in one step
    while the pod's gRPC side still answers: past --step-timeout its load
    reports say `stalled` and its health is NOT_SERVING (so the gateway ends
    its streams and the kubelet takes it out); once the step ends both turn
    back and the request completes."""
    step_timeout = 2.0
    args = [*POD_ARGS, "--tensor-parallel-size", "2", "--cpu-threads", "2", "--step-timeout", str(step_timeout)]
    with EnginePodProcess(tiny_llama, args, log_path=tmp_path / "pod.log") as pod:
        pod.wait_serving()
        assert not load(pod.address).stalled
        workers = _children(pod.proc.pid)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            with pod_channel(pod.address) as channel:
                call = pb_grpc.EngineStub(channel).Generate(greedy([5, 6, 7], 4), timeout=60)
                stopped = time.monotonic()
                while not load(pod.address).stalled:
                    assert time.monotonic() - stopped < step_timeout + 10, "never reported stalled"
                    time.sleep(0.1)
                assert time.monotonic() - stopped > step_timeout - 0.5  # not before the timeout
                assert health_status(pod.address) == health_pb2.HealthCheckResponse.NOT_SERVING
                for pid in workers:
                    os.kill(pid, signal.SIGCONT)
                responses = list(call)
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        assert responses[-1].finish_reason == "length"
        deadline = time.monotonic() + 10
        while load(pod.address).stalled or health_status(pod.address) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "never recovered"
            time.sleep(0.1)
        assert "engine loop stalled" in (tmp_path / "pod.log").read_text()
