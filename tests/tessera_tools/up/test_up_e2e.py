"""`tessera up` as a user runs it: a subprocess on examples/local-tiny.yaml."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from tessera.child_process import free_port
from tessera.internal_secret import InternalSecret
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[3]


def _children(pid: int) -> dict[int, str]:
    """Direct children of `pid` (from /proc) and their command lines."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


class Up:
    def __init__(self, models_dir: Path, log_dir: Path, example: str = "local-tiny.yaml") -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.log_dir = log_dir
        self.log = open(log_dir / "up.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tessera_tools.cli", "up", "-f", str(ROOT / "examples" / example),
             "--models-dir", str(models_dir), "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
             "--log-dir", str(log_dir)], stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_up(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()
            if "Tessera is up" in Path(self.log.name).read_text():
                return
            time.sleep(0.2)
        raise TimeoutError(Path(self.log.name).read_text())

    def complete(self, prompt: str = "Hello", max_tokens: int = 4) -> httpx.Response:
        return httpx.post(self.base_url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens})

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def up(tiny_llama, tmp_path):
    # examples/local-tiny.yaml names the PVC path `tiny`: the test checkpoint cache stands in for the PVC.
    platform = Up(tiny_llama.parent, tmp_path)
    yield platform
    platform.stop()


def test_up_serves_rest_and_grpc_and_sigint_leaves_no_process(up):
    up.wait_up()
    children = _children(up.proc.pid)
    kinds = sorted(cmd.split("tessera_tools.cli ")[1].split()[0] for cmd in children.values())
    assert kinds == ["engine", "engine", "gateway"]
    # No credential in any process's argv (world-readable): each child gets the run's internal
    # secret as a private file its environment names.
    secret_file = up.log_dir / "internal-secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    secret = InternalSecret.load(secret_file)
    for pid in [up.proc.pid, *children]:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert secret.value not in cmdline and secret.token.encode() not in cmdline, cmdline
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"TESSERA_INTERNAL_SECRET_FILE={secret_file}".encode() in environ
        # The test run's own TESSERA_INTERNAL_SECRET is not passed on: the run's file is the only secret.
        assert [v for v in environ if v.startswith(b"TESSERA_INTERNAL_SECRET=")] == [b"TESSERA_INTERNAL_SECRET="]
    # /metrics on the port the banner names, not on the public one.
    metrics_url = re.search(r"metrics\s+(http://\S+/metrics)", Path(up.log.name).read_text()).group(1)
    assert "tessera_gateway" in httpx.get(metrics_url, timeout=5).text
    assert httpx.get(up.base_url + "/metrics", timeout=5).status_code == 404
    r = up.complete()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    with grpc.insecure_channel(f"127.0.0.1:{up.grpc_port}") as channel:
        chunks = list(pb_grpc.InferenceStub(channel).Complete(pb.CompletionRequest(
            model="tiny", prompt="Hello", params=pb.GenerationParams(max_tokens=3, ignore_eos=True))))
    assert chunks[-1].usage.completion_tokens == 3
    assert up.stop() == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in children):
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)], "children outlived tessera up"
    assert not secret_file.exists()  # the next run makes its own


def _readme_first_request(port: int) -> str:
    """What the README's first request prints, pointed at this platform's port."""
    readme = (ROOT / "README.md").read_text()
    snippet = readme.split("## A first request", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    snippet = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_make_run_answers_the_readmes_first_request(smollm2, tmp_path):
    """`make run`'s platform (examples/local.yaml, the real model): the README's first request
    prints the right answer, and gRPC's ChatUnary gives the same."""
    platform = Up(smollm2.parent, tmp_path, example="local.yaml")
    try:
        platform.wait_up()
        assert "Paris" in _readme_first_request(platform.http_port)
        with grpc.insecure_channel(f"127.0.0.1:{platform.grpc_port}") as channel:
            result = pb_grpc.InferenceStub(channel).ChatUnary(pb.ChatRequest(
                model="smollm2-135m-instruct", params=pb.GenerationParams(max_tokens=32, temperature=0),
                messages=[pb.ChatMessage(role="user", content="What is the capital of France?")]), timeout=60)
        assert "Paris" in result.choices[0].text and result.choices[0].finish_reason == "stop"
    finally:
        assert platform.stop() == 0


def test_a_killed_engine_is_restarted_while_the_other_serves(up):
    up.wait_up()
    engines = {pid: cmd for pid, cmd in _children(up.proc.pid).items() if "tessera_tools.cli engine" in cmd}
    victim = min(engines)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    # Requests keep succeeding on the other replica meanwhile.
    for i in range(10):
        assert up.complete(f"while one pod is down {i}").status_code == 200
    # The supervisor restarts it (same command, same port) and the gateway routes to it again.
    deadline = killed_at + 90
    while time.monotonic() < deadline:
        now = {pid: cmd for pid, cmd in _children(up.proc.pid).items() if "tessera_tools.cli engine" in cmd}
        health = httpx.get(up.base_url + "/health", timeout=5).json()
        if len(now) == 2 and victim not in now and health.get("pods") == 2:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the killed engine was not back within 90 s")
    assert engines[victim] in now.values()
    assert all(up.complete(f"after {i}").status_code == 200 for i in range(4))


def _wait_batch(up: Up, batch_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = httpx.get(f"{up.base_url}/v1/batches/{batch_id}", timeout=10, headers=_BATCH_KEY).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.5)
    raise TimeoutError(f"batch {batch_id} did not finish within {timeout:.0f} s")


# examples/local-batch.yaml names no tenants file: open access, any key is the anonymous tenant.
_BATCH_KEY = {"Authorization": "Bearer local"}


def test_batch_example_serves_the_batch_api_and_its_batches_survive_a_restart(tiny_llama, tmp_path):
    """examples/local-batch.yaml: /v1/files and /v1/batches are served, a batch runs, and after
    `tessera up` stops and starts again on the same state directory the batch and its output are
    still there: the folder stays, and so does the secret whose key signs the records."""
    import json

    up = Up(tiny_llama.parent, tmp_path, example="local-batch.yaml")
    try:
        up.wait_up()
        assert "/v1/batches" in Path(up.log.name).read_text()  # the banner names it
        lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "tiny", "prompt": f"Question {i}", "max_tokens": 3}} for i in range(3)]
        upload = httpx.post(f"{up.base_url}/v1/files", headers=_BATCH_KEY, timeout=30, data={"purpose": "batch"},
                            files={"file": ("in.jsonl", "\n".join(map(json.dumps, lines)).encode())})
        assert upload.status_code == 200, upload.text
        created = httpx.post(f"{up.base_url}/v1/batches", headers=_BATCH_KEY, timeout=30,
                             json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                   "completion_window": "24h"})
        assert created.status_code == 200, created.text
        batch = _wait_batch(up, created.json()["id"])
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 3
        assert (tmp_path / "batch" / "batches").is_dir()
        assert stat.S_IMODE((tmp_path / "gateway.yaml").stat().st_mode) == 0o600  # where a batch.redis_url would be
        assert up.stop() == 0
        secret = tmp_path / "internal-secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600  # kept for the next run
        kept = secret.read_bytes()
    finally:
        up.stop()
    again = Up(tiny_llama.parent, tmp_path, example="local-batch.yaml")  # the same state directory
    try:
        again.wait_up()
        assert (tmp_path / "internal-secret").read_bytes() == kept
        found = httpx.get(f"{again.base_url}/v1/batches/{batch['id']}", headers=_BATCH_KEY, timeout=10)
        assert found.status_code == 200 and found.json()["status"] == "completed"
        output = httpx.get(f"{again.base_url}/v1/files/{batch['output_file_id']}/content", headers=_BATCH_KEY,
                           timeout=10)
        assert sorted(json.loads(line)["custom_id"] for line in output.text.splitlines()) == ["q0", "q1", "q2"]
    finally:
        again.stop()


def test_batch_redis_runs_in_the_runs_redis_with_the_url_in_the_gateways_environment(tiny_llama, tmp_path):
    """spec.batch.redis under `tessera up`: the gateway keeps batches in the Redis the run starts for
    kvStore.redis, whose URL it reads from TESSERA_BATCH_REDIS_URL (as the operator's gateway pods do),
    not from its config file nor its command line."""
    import json

    import redis as redis_py

    resource = yaml.safe_load((ROOT / "examples" / "local-batch.yaml").read_text())
    resource["spec"]["kvStore"] = {"redis": {"urlSecretRef": {"name": "tessera-redis"}}}
    resource["spec"]["batch"] = {"priorityClass": "batch", "redis": {"urlSecretRef": {"name": "batch-redis"}}}
    path = tmp_path / "local-batch-redis.yaml"
    path.write_text(yaml.safe_dump(resource))
    up = Up(tiny_llama.parent, tmp_path, example=str(path))  # an absolute path replaces examples/
    try:
        up.wait_up()
        lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "tiny", "prompt": f"Question {i}", "max_tokens": 3}} for i in range(2)]
        upload = httpx.post(f"{up.base_url}/v1/files", headers=_BATCH_KEY, timeout=30, data={"purpose": "batch"},
                            files={"file": ("in.jsonl", "\n".join(map(json.dumps, lines)).encode())})
        assert upload.status_code == 200, upload.text
        created = httpx.post(f"{up.base_url}/v1/batches", headers=_BATCH_KEY, timeout=30,
                             json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                   "completion_window": "24h"})
        assert created.status_code == 200, created.text
        batch = _wait_batch(up, created.json()["id"])
        assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 2
        config = (tmp_path / "gateway.yaml").read_text()
        assert "redis_url" not in config and "redis://" not in config and "key_prefix" in config
        gateway = [pid for pid, cmd in _children(up.proc.pid).items() if " gateway --config " in cmd]
        assert len(gateway) == 1
        environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{gateway[0]}/environ").read_bytes().split(b"\0")
                       if b"=" in item)
        url = environ[b"TESSERA_BATCH_REDIS_URL"].decode()
        assert url.startswith("redis://127.0.0.1:") and url not in _children(up.proc.pid)[gateway[0]]
        keys = [k.decode() for k in redis_py.Redis.from_url(url, socket_timeout=5).keys("*")]
        assert any(k.startswith("tessera:default/local-batch:batch:batch:") for k in keys), keys
    finally:
        up.stop()
