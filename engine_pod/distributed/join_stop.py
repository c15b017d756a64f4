"""Stopping a process of a multi-node engine while its group is still joining.

A leader waits up to its join timeout (600 s by default: a large checkpoint
loads slowly) for the other nodes, and a node as long for its leader. A pod
asked to stop meanwhile (SIGTERM: a rollout, a scale-down, Ctrl-C on
`tessera up`) must not wait that out. The leader's join runs deep inside the
engine core's start-up, far from the signal handler, so the request travels
as a process-wide event: `tessera engine` sets ``JOIN_STOP`` from its
SIGTERM/SIGINT handler, the join loops (executor/node_acceptor.py on the
leader, node_channel.connect_to_leader on a node) check it several times a
second and raise ``JoinStopped``; the process then stops what it started and
exits 0, as a pod being stopped does.
"""

from __future__ import annotations

import threading

JOIN_STOP = threading.Event()
"""Set (signal-safe) when this process is asked to stop; only the join loops act on it."""


class JoinStopped(Exception):
    """The process was asked to stop while its engine group was joining; str(e) says who was awaited."""


__all__ = ["JOIN_STOP", "JoinStopped"]
