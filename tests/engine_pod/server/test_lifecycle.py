"""Start-up health, SIGTERM drain, load shedding and bad flags of the engine pod."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine_pod.server.process import EnginePodProcess, free_port
from tessera.v1 import engine_pb2_grpc as pb_grpc
from tests.engine_pod.server.client import collect, greedy, load, pod_aio_channel
from tests.engine_pod.server.conftest import POD_ARGS

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_goes_from_not_serving_to_serving(tiny_llama, tmp_path):
    with EnginePodProcess(tiny_llama, POD_ARGS, log_path=tmp_path / "pod.log") as pod:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and SERVING not in seen:
            status = pod.health(timeout=0.5)
            if status is not None and (not seen or seen[-1] != status):
                seen.append(status)
            time.sleep(0.01)
        # The port opens before the model loads: health answers NOT_SERVING first.
        assert seen == [NOT_SERVING, SERVING]


def test_sigterm_drains_in_flight_and_rejects_new(tiny_llama, tmp_path):
    pod = EnginePodProcess(tiny_llama, POD_ARGS + ["--drain-timeout", "60"], log_path=tmp_path / "pod.log")
    pod.wait_serving()

    async def run():
        async with pod_aio_channel(pod.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            calls = [stub.Generate(greedy([5 + i] * 30, 120, ignore_eos=True)) for i in range(3)]
            firsts = [await c.read() for c in calls]
            assert all(f.token_ids for f in firsts)
            pod.proc.send_signal(__import__("signal").SIGTERM)
            await asyncio.sleep(0.3)
            assert pod.health() == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, greedy([5], 2))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            results = []
            for first, call in zip(firsts, calls):
                tokens, reason = list(first.token_ids), ""
                while (resp := await call.read()) is not grpc.aio.EOF:
                    tokens += resp.token_ids
                    reason = resp.finish_reason or reason
                results.append((len(tokens), reason))
            return results

    results = asyncio.run(run())
    assert results == [(120, "length")] * 3
    assert pod.proc.wait(timeout=60) == 0


def test_queue_bound_answers_resource_exhausted(tiny_llama, tmp_path):
    args = POD_ARGS + ["--max-num-seqs", "1", "--max-waiting-requests", "2"]
    with EnginePodProcess(tiny_llama, args, log_path=tmp_path / "pod.log") as pod:
        pod.wait_serving()

        async def run():
            async with pod_aio_channel(pod.address) as channel:
                stub = pb_grpc.EngineStub(channel)
                running = stub.Generate(greedy([5] * 10, 200, ignore_eos=True))
                await running.read()
                queued = [stub.Generate(greedy([6 + i] * 10, 200, ignore_eos=True)) for i in range(2)]
                deadline = time.monotonic() + 10
                while load(pod.address).num_waiting < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(stub, greedy([9], 2))
                for call in [running, *queued]:
                    call.cancel()
                return info.value

        error = asyncio.run(run())
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue" in error.details()


@pytest.mark.parametrize("flag,value,field", [
    ("--role", "router", "role"),
    ("--tensor-parallel-size", "0", "tensor_parallel_size"),
    ("--pipeline-parallel-size", "0", "pipeline_parallel_size"),
    ("--max-waiting-requests", "0", "max_waiting_requests"),
    ("--drain-timeout", "-1", "drain_timeout"),
    ("--kv-host-bytes", "-1", "kv_host_bytes"),
    ("--kv-redis-url", "http://nope", "kv_redis_url"),
    ("--kv-write-queue-size", "0", "kv_write_queue_size"),
    ("--kv-inbox-bytes", "-1", "kv_inbox_bytes"),
    ("--kv-direct-timeout", "0", "kv_direct_timeout_s"),
    ("--kv-redis-timeout", "nan", "kv_redis_timeout"),
    ("--background-priority", "20", "background_priority"),  # without --scheduling-policy priority
    ("--background-max-batched-tokens", "0", "background_max_batched_tokens"),
    ("--cpu-threads", "-1", "cpu_threads"),
    ("--step-timeout", "-1", "step_timeout"),
    ("--health-port", "50061", "health_port"),  # the default --grpc-port
    ("--tls-cert-file", "/nonexistent.pem", "--tls-key-file"),  # all three or none
])
def test_bad_flags_exit_2_naming_the_field(tiny_llama, flag, value, field, monkeypatch, capsys):
    """In this process (the tests below run the command as a process and see
    its exit status); a value the checks let through fails the test where
    the pod would start its engine, instead of serving."""
    from engine_pod.server import main as pod_main
    from tessera_tools.cli import main

    def past_the_checks(*_args):
        raise AssertionError(f"{flag} {value} got past the checks")

    monkeypatch.setattr(pod_main, "_executor_factory", past_the_checks)
    assert main(["engine", "--model", str(tiny_llama), flag, value]) == 2
    assert field in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "0"], "nnodes must be a positive integer"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "x"], "node_rank must be in 0..nnodes-1"),
    (["--node-rank", "-1"], "node_rank must be in 0..nnodes-1"),
    (["--nnodes", "2", "--pipeline-parallel-size", "2"], "master_addr: required with nnodes=2"),
    (["--nnodes", "2", "--pipeline-parallel-size", "2", "--master-addr", "x", "--master-port", "65535"],
     "master_port must be in 1-65534"),
    (["--nnodes", "2", "--master-addr", "x"], "nnodes=2 does not divide the world size 1"),
    (["--nnodes", "3", "--pipeline-parallel-size", "2", "--master-addr", "x"], "nnodes=3 does not divide"),
    (["--nnodes", "2", "--pipeline-parallel-size", "2", "--master-addr", "x", "NO_SECRET"],
     "--nnodes 2: the nodes authenticate each other with the internal secret"),
])
def test_bad_multi_node_flags_exit_2_with_the_reason(tiny_llama, flags, message):
    env = dict(os.environ)
    if "NO_SECRET" in flags:
        flags = [f for f in flags if f != "NO_SECRET"]
        env.pop("TESSERA_INTERNAL_SECRET", None)
        env.pop("TESSERA_INTERNAL_SECRET_FILE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tessera_tools.cli", "engine", "--model", str(tiny_llama), "--no-internal-auth",
         *flags], capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--kv-inbox-port", "50070"], "--kv-inbox-port needs --kv-inbox-bytes"),
    (["--kv-inbox-bytes", "1048576", "--kv-inbox-port", "70000"], "kv_inbox_port"),
    (["--kv-inbox-bytes", "1048576", "--kv-inbox-port", "GRPC"], "overlap"),
    (["--kv-inbox-bytes", "1048576", "--kv-inbox-port", "TAKEN"], "--kv-inbox-port: cannot listen on 127.0.0.1:"),
])
def test_bad_kv_inbox_ports_exit_2_with_the_reason(tiny_llama, flags, message):
    grpc_port = free_port()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        ports = {"GRPC": str(grpc_port), "TAKEN": str(taken.getsockname()[1])}
        proc = subprocess.run(
            [sys.executable, "-m", "tessera_tools.cli", "engine", "--model", str(tiny_llama), "--grpc-port",
             str(grpc_port), "--metrics-port", "0", *[ports.get(f, f) for f in flags]],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
