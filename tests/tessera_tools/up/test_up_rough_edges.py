"""`tessera up`'s edges: a taken port fails fast with one line, the banner names every
component's address, and stopping ends with a closing line. Real `tessera up`
subprocesses and a real gateway child; no model is ever served here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tessera.child_process import free_port
from tessera.internal_secret import SECRET_ENV, SECRET_FILE_ENV, InternalSecret
from tessera_tools.up.plan import LocalOptions, build_plan
from tessera_tools.up.runner import _LoggedChild, banner, write_secret_file
from tessera_tools.up.supervisor import ChildFailed, Supervisor
from tests.tessera_tools.up.test_up_e2e import _alive, _children

ROOT = Path(__file__).resolve().parents[3]
LOCAL = ROOT / "examples" / "local-tiny.yaml"


def _listening_socket() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def _up(models_dir: Path, log_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tessera_tools.cli", "up", "-f", str(LOCAL), "--models-dir", str(models_dir),
            "--log-dir", str(log_dir), *flags]


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port", "--metrics-port"])
def test_a_taken_gateway_port_fails_fast_naming_the_port_and_its_holder(flag, tiny_llama, tmp_path):
    held, port = _listening_socket()
    ports = {"--http-port": free_port(), "--grpc-port": free_port(), "--metrics-port": free_port(), flag: port}
    with held:
        result = subprocess.run(_up(tiny_llama.parent, tmp_path, *[str(x) for kv in ports.items() for x in kv]),
                                capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"tessera up: error: {flag} {port}: cannot listen on 127.0.0.1:{port}: "
                               f"address already in use (held by pid {os.getpid()}: "), lines[0]
    # Nothing was started: no child log, no secret file.
    assert not list(tmp_path.iterdir())


def test_the_same_port_for_two_flags_is_refused(tiny_llama, tmp_path):
    port = free_port()
    result = subprocess.run(_up(tiny_llama.parent, tmp_path, "--http-port", str(port), "--grpc-port", str(port)),
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"tessera up: error: --grpc-port {port}: the same port as --http-port; "
                                     "each needs its own")


def test_a_child_that_cannot_bind_its_port_ends_the_run_instead_of_restarting(tiny_llama, tmp_path):
    """The port is taken after the check (a race): the gateway exits at start, and
    the supervisor stops with the child's own line instead of restarting it forever."""
    held, port = _listening_socket()
    plan = build_plan(yaml.safe_load(LOCAL.read_text()),
                      LocalOptions(models_dir=tiny_llama.parent, http_port=port, grpc_port=free_port()), free_port)
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump(plan.gateway_config))
    secret = write_secret_file(tmp_path / "secret", InternalSecret.generate())
    gateway = _LoggedChild(["gateway", "--config", str(config)], tmp_path / "gateway.log",
                           {SECRET_FILE_ENV: str(secret), SECRET_ENV: ""})
    supervisor = Supervisor()
    with held:
        supervisor.add("gateway", gateway.start, stop_order=0, fatal_cause=gateway.bind_failure)
        try:
            deadline = time.monotonic() + 90
            with pytest.raises(ChildFailed) as failed:
                while time.monotonic() < deadline:
                    supervisor.check()
                    time.sleep(0.1)
        finally:
            supervisor.stop()
    message = str(failed.value)
    assert message.startswith("gateway exited with "), message
    assert "address already in use" in message.lower() and str(port) in message, message
    assert supervisor.children["gateway"].restarts == 0


def test_the_banner_names_every_component_address(tiny_llama, tmp_path):
    options = LocalOptions(models_dir=tiny_llama.parent, http_port=8123, grpc_port=8124)
    plan = build_plan(yaml.safe_load(LOCAL.read_text()), options, free_port)
    text = banner(plan, options, tmp_path)
    assert "REST     http://127.0.0.1:8123/v1" in text
    assert "gRPC     127.0.0.1:8124" in text
    assert f"metrics  http://127.0.0.1:{plan.metrics_port}/metrics" in text
    assert len(plan.engines) == 2
    for engine in plan.engines:
        assert (f"{engine.name}  gRPC 127.0.0.1:{engine.grpc_port}  "
                f"metrics http://127.0.0.1:{engine.metrics_port}/metrics") in text


def test_stopping_ends_with_a_closing_line(tiny_llama, tmp_path):
    """Ctrl-C before the platform is ready still stops every child and says how many."""
    log = tmp_path / "up.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(_up(tiny_llama.parent, tmp_path / "logs", "--http-port", str(free_port()),
                                    "--grpc-port", str(free_port())), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            deadline = time.monotonic() + 60
            while len(_children(proc.pid)) < 3 and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.05)
            children = _children(proc.pid)
            assert len(children) == 3, log.read_text()  # two engines and the gateway
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = log.read_text().strip().splitlines()
    assert lines[-1] == "tessera up: stopped 3 processes", lines
    assert not any(_alive(pid) for pid in children)


@pytest.mark.parametrize("flags, message", [
    (["--ready-timeout", "0"], "--ready-timeout: must be a number > 0"),
    (["--ready-timeout", "inf"], "--ready-timeout: must be a number > 0"),
    (["--simulate", "no-such-profile.json"], "--simulate no-such-profile.json: no such step-time profile"),
])
def test_bad_flags_exit_2_before_anything_starts(tiny_llama, tmp_path, flags, message):
    result = subprocess.run(_up(tiny_llama.parent, tmp_path, *flags), capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())  # nothing started: no child log, no secret file
