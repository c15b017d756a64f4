"""A `tessera` component run as a child process: tests, benchmarks and the
local platform runner start engine pods and gateways this way, with the
same commands a Kubernetes pod runs."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


_handed_out: set[int] = set()


def _ephemeral_start(default: int = 32768) -> int:
    """The first port Linux hands to outgoing connections as their source port."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port(attempts: int = 200) -> int:
    """A loopback port free right now for a child to listen on, never one this process handed
    out before, and below the ephemeral range where one is free there. A port the kernel picks
    (bind to 0) lies in that range, where any outgoing connection on the machine may take it
    as its source port before the child binds it: two pods started together once met that way
    ("Address already in use")."""
    top = min(_ephemeral_start(), 60000)
    for _ in range(attempts if top > 20100 else 0):
        port = random.randrange(20000, top)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def free_port_pair(attempts: int = 200) -> int:
    """A loopback port P such that P and P + 1 are both free right now and neither was handed out
    before (a multi-node engine's leader listens on both: its rendezvous store and, next to it, its
    node channel): free_port_range(2)."""
    return free_port_range(2, attempts)


def port_is_free(port: int) -> bool:
    """Whether a socket can bind ``port`` on loopback right now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(count: int, attempts: int = 200) -> int:
    """The first of ``count`` consecutive loopback ports free right now, none handed out before
    and all below the ephemeral range, as free_port's are (a host of simulated pods listens on
    consecutive ports); all count as handed out. Ranges once came from the ephemeral range and
    were not remembered, so a pod's probed port could be another's, or an outgoing connection's,
    by the time it bound it ("Address already in use")."""
    top = min(_ephemeral_start(), 60000)
    for _ in range(attempts if top > 20000 + count + 100 else 0):
        first = random.randrange(20000, top - count)
        ports = range(first, first + count)
        if any(p in _handed_out for p in ports) or not all(port_is_free(p) for p in ports):
            continue
        _handed_out.update(ports)
        return first
    raise RuntimeError(f"no {count} consecutive free loopback ports found below the ephemeral range")


PARENT_PID_ENV = "TESSERA_PARENT_PID"


def die_with_parent() -> None:
    """Called by a child at start-up (tessera_tools.cli): SIGTERM when the parent
    that started it dies, so a killed parent leaves no orphans. Set here
    rather than in a preexec_fn: that would make subprocess fork() a parent
    whose gRPC threads can deadlock the fork."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the parent died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


class ChildProcess:
    def __init__(self, args: list[str], env: dict | None = None, log_path: str | Path | None = None,
                 cpus: frozenset[int] | None = None) -> None:
        """Runs `python -m tessera_tools.cli ARGS`, its output appended to `log_path`
        (or nowhere), pinned to `cpus` when given. The child gets its own
        session (a terminal's Ctrl-C reaches only the parent, which stops
        children in order) and dies with the parent (`die_with_parent`)."""
        self._log = open(log_path, "a") if log_path else subprocess.DEVNULL
        env = {**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())}
        self.proc = subprocess.Popen([sys.executable, "-m", "tessera_tools.cli", *args], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if cpus:
            # Before the child starts its thread pools (model loading takes
            # seconds), so every thread it creates inherits the CPU set.
            os.sched_setaffinity(self.proc.pid, cpus)

    def check_alive(self, what: str) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {self.proc.returncode} before serving")

    def request_stop(self) -> None:
        """SIGTERM without waiting (stop several children at once, then wait)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (the component drains), then wait for the exit code,
        killing it after the timeout."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not isinstance(self._log, int):  # an open log file, not subprocess.DEVNULL
            self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()
