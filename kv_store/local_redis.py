"""Start and stop a private redis-server (tests, benchmarks, local runs)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from engine_pod.server.process import free_port  # noqa: E402 - one home for free ports


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.port = port or free_port()
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(workdir)]
        if password:
            args += ["--requirepass", password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=password, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.client = client

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
