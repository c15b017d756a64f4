"""A `tessera` component run as a child process: tests, benchmarks and the
local platform runner start engine pods and gateways this way, with the
same commands a Kubernetes pod runs."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_setup(cpus: frozenset[int] | None) -> Callable[[], None]:
    """Runs in the child before exec: its own process group (a terminal's
    Ctrl-C reaches only the parent, which stops children in order), SIGTERM
    when the parent dies (no orphans even if the parent is killed), and the
    CPUs it may run on."""

    def setup() -> None:
        os.setsid()
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


class ChildProcess:
    def __init__(self, args: list[str], env: dict | None = None, log_path: str | Path | None = None,
                 cpus: frozenset[int] | None = None) -> None:
        """Runs `python -m tessera.cli ARGS`, its output appended to `log_path`
        (or nowhere), pinned to `cpus` when given."""
        self._log = open(log_path, "a") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "tessera.cli", *args], env={**os.environ, **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_child_setup(cpus))

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
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()
