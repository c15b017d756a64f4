"""Keeps the local platform's child processes running.

A child that exits on its own is restarted after a back-off that doubles
(1 s, 2 s, 4 s ... up to 30 s) and resets once the child has run for a
minute; meanwhile the gateway routes around it. A child whose exit has a
cause no restart can cure (its port is taken: `fatal_cause`) ends the run
instead (ChildFailed). A child may be a group of processes that stand and
fall together (child_group.py: a pipeline-parallel engine's leader and
nodes): it has exited once any member has and the rest have stopped, and it
restarts whole. Shutdown stops the gateway
first (no new requests), then the engines (each drains its in-flight
requests), then anything else (Redis), killing what outlives its timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.child_process import ChildProcess
from tessera_tools.up.child_group import RunningGroup

logger = logging.getLogger(__name__)

MIN_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0


class ChildFailed(Exception):
    """A child exited for a cause a restart would meet again; str(e) names the child and the cause."""


@dataclass
class Supervised:
    name: str
    start: Callable[[], ChildProcess | RunningGroup]
    # Lower stops first.
    stop_order: int
    # After an exit: why restarting cannot help (one line), or None to restart.
    fatal_cause: Callable[[], str | None] | None = None
    process: ChildProcess | RunningGroup | None = None
    started_at: float = 0.0
    backoff_s: float = MIN_BACKOFF_S
    restart_at: float | None = None
    restarts: int = 0
    history: list[str] = field(default_factory=list)


class Supervisor:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.children: dict[str, Supervised] = {}
        self.clock = clock
        self.stopping = False
        # Processes still running when stop() came, which it stopped (a group's members each count).
        self.num_stopped = 0

    def add(self, name: str, start: Callable[[], ChildProcess | RunningGroup], stop_order: int,
            fatal_cause: Callable[[], str | None] | None = None) -> Supervised:
        child = Supervised(name, start, stop_order, fatal_cause)
        self.children[name] = child
        self._launch(child)
        return child

    def _launch(self, child: Supervised) -> None:
        child.process = child.start()
        child.started_at = self.clock()
        child.restart_at = None

    def check(self) -> None:
        """One supervision pass: notice exits, restart when their back-off is over."""
        if self.stopping:
            return
        now = self.clock()
        for child in self.children.values():
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    logger.warning("up: restarting %s (restart %d)", child.name, child.restarts)
                    self._launch(child)
                continue
            code = child.process.proc.poll()
            if code is None:
                if now - child.started_at >= STABLE_AFTER_S:
                    child.backoff_s = MIN_BACKOFF_S
                continue
            child.history.append(f"exited with {code}")
            cause = child.fatal_cause() if child.fatal_cause is not None else None
            if cause is not None:
                raise ChildFailed(f"{child.name} exited with {code}: {cause}")
            child.restart_at = now + child.backoff_s
            logger.error("up: %s exited with %s; restarting in %.0f s", child.name, code, child.backoff_s)
            child.backoff_s = min(MAX_BACKOFF_S, child.backoff_s * 2)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every child in order; nothing is left running afterwards."""
        self.stopping = True
        self.num_stopped = sum(_processes(c.process) for c in self.children.values()
                               if c.process is not None and c.process.proc.poll() is None)
        for order in sorted({c.stop_order for c in self.children.values()}):
            group = [c for c in self.children.values() if c.stop_order == order and c.process is not None]
            for child in group:
                child.process.request_stop()
            for child in group:
                child.process.terminate(timeout_s)


def _processes(process: ChildProcess | RunningGroup) -> int:
    """How many processes a running child is: a group counts its members still running."""
    return process.num_running if isinstance(process, RunningGroup) else 1
