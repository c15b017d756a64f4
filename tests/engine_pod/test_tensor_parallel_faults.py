"""Tensor-parallel life cycle: failures surface fast with their cause, bad
sizes fail at start-up, and no worker process outlives its engine."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engine_pod import LLM, SamplingParams
from engine_pod.config import ParallelConfig
from engine_pod.executor.multiproc import WorkerError
from engine_pod.model.hf_config import load_arch_config

ROOT = Path(__file__).resolve().parents[2]
KW = dict(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=32 << 20, device="cpu")


def _alive(pid: int) -> bool:
    """Running, not merely a zombie awaiting its reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def test_killing_a_worker_fails_generate_fast_and_leaves_no_process(tiny_llama):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **KW)
    pids = llm.engine_core.executor.worker_pids
    killed_at: list[float] = []

    def kill_once_decoding():
        while llm.stats.steps < 20:
            time.sleep(0.01)
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_once_decoding, daemon=True)
    killer.start()
    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
        llm.generate([f"prompt number {i}" for i in range(8)], params)
    assert time.monotonic() - killed_at[0] < 5.0
    killer.join()
    assert _wait_gone(pids, 1.0) == []
    # The engine stays failed with the same cause; shutting down is harmless.
    with pytest.raises(WorkerError, match="rank 1"):
        llm.generate(["again"], SamplingParams(max_tokens=2))
    llm.shutdown()


def test_a_worker_that_raises_fails_with_its_traceback(tiny_llama):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **KW)
    pids = llm.engine_core.executor.worker_pids
    with pytest.raises(WorkerError, match="AttributeError") as info:
        llm.engine_core.executor.collective_rpc("no_such_method")
    assert "no_such_method" in str(info.value)
    assert _wait_gone(pids, 1.0) == []
    llm.shutdown()


def test_shutdown_stops_every_worker(tiny_llama):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **KW)
    pids = llm.engine_core.executor.worker_pids
    assert all(_alive(p) for p in pids)
    llm.shutdown()
    assert _wait_gone(pids, 1.0) == []


def test_workers_exit_when_the_engine_process_is_killed(tiny_llama):
    script = textwrap.dedent(f"""
        import time
        from engine_pod import LLM
        if __name__ == "__main__":
            llm = LLM({str(tiny_llama)!r}, tensor_parallel_size=2, **{KW!r})
            print(*llm.engine_core.executor.worker_pids, flush=True)
            time.sleep(120)
    """)
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        engine.kill()
        engine.wait()
        assert _wait_gone(pids, 5.0) == []
    finally:
        engine.kill()
        engine.wait()


def test_tp_size_not_dividing_the_heads_names_both_numbers(tiny_llama):
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_llama), tensor_parallel_size=3, **KW)
    assert "tensor_parallel_size=3" in str(info.value)
    assert "num_attention_heads=4" in str(info.value)


def test_tp_size_must_split_or_replicate_kv_heads_evenly(tiny_llama):
    arch = dataclasses.replace(load_arch_config(tiny_llama), num_attention_heads=12, num_key_value_heads=4,
                               intermediate_size=1200)
    with pytest.raises(ValueError, match="tensor_parallel_size=6 .*num_key_value_heads=4"):
        ParallelConfig(6).validate_for(arch)
    ParallelConfig(2).validate_for(arch)
    ParallelConfig(12).validate_for(arch)  # 3 ranks per replicated KV head


@pytest.mark.parametrize("size", [0, -1])
def test_tp_size_must_be_positive(tiny_llama, size):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tiny_llama), tensor_parallel_size=size, **KW)
