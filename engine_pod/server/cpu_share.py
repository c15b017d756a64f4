"""How many CPU threads an engine pod may use.

torch sizes its thread pool from the machine's cores, not from the pod's
CPU limit: a pod limited to 2 CPUs on a 64-core node would run 64 threads
and thrash. Pods that share a machine (tests, `tessera up`) must split the
cores between them, or their spinning OpenMP threads slow each other down
by an order of magnitude.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup's CFS quota (v2 `cpu.max` or v1), if any."""
    v2 = root / "cpu.max"
    if v2.is_file():
        quota, _, period = v2.read_text().strip().partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    quota_file, period_file = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
    if quota_file.is_file() and period_file.is_file():
        quota = int(quota_file.read_text())
        if quota > 0:
            return quota / int(period_file.read_text())
    return None


def cpu_share(root: Path = Path("/sys/fs/cgroup")) -> int:
    """Threads for this process: its CPU affinity, capped by the cgroup quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)
