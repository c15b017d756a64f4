"""A pipeline-parallel engine's processes (leader + nodes), supervised as one child.

In a cluster a lost stage fails the engine and the LeaderWorkerSet restarts
the whole group together (RecreateGroupOnPodRestart); here the supervisor
gets a group that behaves as one child the same way. It has exited once any
member has: the others are then stopped (SIGTERM; killed if they outlive
STOP_GRACE_S) before the group reports its exit, so a restart never meets
half of the old group, and the log says which member went first. Every start
launches every member again, on the same ports.

Stopping the run stops the leader first: it drains its in-flight requests
and then shuts its nodes down over the group's own channel (they exit 0);
whatever node remains is stopped after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tessera.child_process import ChildProcess

logger = logging.getLogger(__name__)

# How long the rest of a group may take to stop after one member exited before it is killed.
STOP_GRACE_S = 10.0


class Startable(Protocol):
    """One member's command: how to start it, and why its last start could not serve."""

    def start(self) -> ChildProcess: ...

    def bind_failure(self) -> str | None: ...


@dataclass
class Member:
    """One process of a group."""

    label: str
    """How the log names it: "leader" or "node K (NAME)"."""
    command: Startable
    """Starts it; tells from its log why its last start exited."""


class ChildGroup:
    """The members of one engine group, the leader first; `start` is what the supervisor calls."""

    def __init__(self, name: str, members: list[Member], clock: Callable[[], float] = time.monotonic) -> None:
        if len(members) < 2:
            raise ValueError(f"{name}: a group has a leader and at least one node, got {len(members)} members")
        self.name = name
        self.members = members
        self.clock = clock

    def start(self) -> RunningGroup:
        return RunningGroup(self.name, [(m.label, m.command.start()) for m in self.members], self.clock)

    def bind_failure(self) -> str | None:
        """The first member's line saying a port could not be bound (no restart helps), or None."""
        for member in self.members:
            cause = member.command.bind_failure()
            if cause is not None:
                return f"{member.label}: {cause}"
        return None


class _GroupStatus:
    """What the supervisor polls of a child (`proc.poll()`, as of a Popen): the group's exit code."""

    def __init__(self, group: RunningGroup) -> None:
        self._group = group

    def poll(self) -> int | None:
        return self._group.poll()


class RunningGroup:
    """One start of a group: its processes, watched and stopped as one child."""

    def __init__(self, name: str, processes: list[tuple[str, ChildProcess]], clock: Callable[[], float]) -> None:
        self.name = name
        self.processes = processes
        self.clock = clock
        self.proc = _GroupStatus(self)
        self.first_exit: tuple[str, int] | None = None
        """(label, exit code) of the member that exited first."""
        self._kill_at = 0.0

    def poll(self) -> int | None:
        """None while every member runs, or while the rest are still stopping after one exited;
        then the first member's exit code."""
        if self.first_exit is None and not self._notice_exit():
            return None
        alive = [child for _, child in self.processes if child.proc.poll() is None]
        if alive and self.clock() >= self._kill_at:
            for child in alive:
                child.proc.kill()
        return None if alive else self.first_exit[1]

    def _notice_exit(self) -> bool:
        for label, child in self.processes:
            code = child.proc.poll()
            if code is not None:
                self.first_exit = (label, code)
                self._kill_at = self.clock() + STOP_GRACE_S
                rest = [other for other, c in self.processes if c.proc.poll() is None]
                logger.error("up: %s: the %s exited with %s; stopping the rest of the group (%s): a pipeline-parallel "
                             "engine runs whole or not at all", self.name, label, code, ", ".join(rest) or "none left")
                for _, other in self.processes:
                    other.request_stop()
                return True
        return False

    @property
    def num_running(self) -> int:
        return sum(child.proc.poll() is None for _, child in self.processes)

    def request_stop(self) -> None:
        """The leader alone: it drains, then shuts its nodes down itself."""
        self.processes[0][1].request_stop()

    def terminate(self, timeout: float = 60.0) -> int:
        """Stop the leader (draining), then any node it left running; the leader's exit code."""
        code = self.processes[0][1].terminate(timeout)
        for _, child in self.processes[1:]:
            child.terminate(timeout)
        return code
