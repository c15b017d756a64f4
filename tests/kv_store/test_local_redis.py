"""The private redis-server of tests, benchmarks and `tessera up`: its password stays out of
the command line, and it does not outlive the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from kv_store.local_redis import RedisServer


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_password_is_not_in_the_command_line(tmp_path):
    server = RedisServer(tmp_path, password="hunter2-local-redis")
    try:
        argv = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert b"hunter2" not in argv
        config = next(tmp_path.glob("redis-*.conf"))
        assert config.stat().st_mode & 0o077 == 0, "the file holding it is its owner's alone"
        assert redis.Redis(port=server.port, password="hunter2-local-redis").ping()
    finally:
        server.stop()


def test_a_killed_parent_leaves_no_server_behind(tmp_path):
    script = ("import sys, time\nfrom pathlib import Path\nfrom kv_store.local_redis import RedisServer\n"
              "server = RedisServer(Path(sys.argv[1]))\nprint(server.proc.pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_bounded_server_evicts_the_least_recently_used_keys(tmp_path):
    server = RedisServer(tmp_path, maxmemory=8 << 20)
    try:
        for i in range(8):
            server.client.set(f"k{i}", bytes(2 << 20))  # 16 MiB written into 8 MiB
        assert server.client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        assert server.client.get("k7") is not None and server.client.get("k0") is None
    finally:
        server.stop()
