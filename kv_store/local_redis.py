"""Start and stop a private redis-server (tests, benchmarks, local runs).

Each server dies with the thread that started it (`setpriv --pdeathsig`, util-linux): a
benchmark or test run that is killed leaves no redis-server behind holding its memory. A
password goes in a configuration file only its owner can read, never in the command line,
where every user of the machine could read it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import redis

from tessera.child_process import free_port, port_is_free  # noqa: E402 - one home for free ports


def _start(args: list[str]) -> subprocess.Popen[bytes]:
    """redis-server, dying with this thread where util-linux's setpriv is at hand."""
    setpriv = shutil.which("setpriv")
    prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
    return subprocess.Popen([*prefix, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _private_config(path: Path, text: str) -> Path:
    """A file only this user can read (created so: never readable by others, even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None,
                 maxmemory: int | None = None) -> None:
        """``maxmemory``: bytes held at most, least recently used keys evicted first (None: unbounded)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.port = port or free_port()
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        args = [binary]
        if password:
            args.append(str(_private_config(workdir / f"redis-{self.port}.conf", f"requirepass {password}\n")))
        args += ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(workdir)]
        if maxmemory is not None:
            args += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"]
        self.proc = _start(args)
        client = redis.Redis(port=self.port, password=password, socket_timeout=0.5)
        _wait_ping(client)
        self.client = client

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class RedisClusterServers:
    """A private three-master Redis Cluster (redis-server + redis-cli --cluster create)."""

    def __init__(self, workdir: Path, num_nodes: int = 3) -> None:
        cli, binary = shutil.which("redis-cli"), shutil.which("redis-server")
        if cli is None or binary is None:
            raise RuntimeError("redis-server and redis-cli must be installed")
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.ports = ports = _cluster_ports(num_nodes)
        for port in ports:
            node_dir = workdir / str(port)
            node_dir.mkdir(parents=True, exist_ok=True)
            self.nodes.append(_start(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no", "--dir", str(node_dir)],
            ))
        for port in ports:
            _wait_ping(redis.Redis(port=port, socket_timeout=0.5))
        subprocess.run(
            [cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        self.url = f"redis://127.0.0.1:{ports[0]}/0"
        client = redis.Redis(port=ports[0], socket_timeout=0.5)
        deadline = time.monotonic() + 20
        while client.cluster("info").get("cluster_state") != "ok":
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster did not reach state ok")
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _wait_ping(client: redis.Redis, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _cluster_ports(n: int) -> list[int]:
    """Free ports whose cluster-bus port (port + 10000) is valid and free too:
    ephemeral ports from free_port() are often above 55535."""
    import random

    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(20000, 45000)
        if port not in ports and port_is_free(port) and port_is_free(port + 10000):
            ports.append(port)
    return ports
