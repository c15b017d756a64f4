"""Keep glibc from returning big freed buffers to the OS on every step.

Each forward allocates and frees tens of megabytes of activations and
gathered KV. By default glibc serves such sizes with mmap and unmaps them
on free, so the next step pays a page fault per 4 KiB again: on a 2-core CPU
that was 3x the cost of the gathers themselves. Raising the mmap and trim
thresholds keeps those buffers in the heap for reuse (what tcmalloc or
jemalloc would give through LD_PRELOAD, without another dependency).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_applied = False


def keep_freed_memory_in_heap(threshold_bytes: int = 1 << 30) -> bool:
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes) == 1 and ok
        # Threads other than the main one allocate from per-thread arenas,
        # whose heaps are capped at 64 MiB: larger buffers fall back to mmap
        # and the thresholds above do not help (the engine loop of a pod runs
        # on its own thread: 30% slower than on the main thread). One arena
        # makes every thread use the main heap.
        ok = libc.mallopt(_M_ARENA_MAX, 1) == 1 and ok
    except (OSError, AttributeError):
        ok = False  # not glibc: nothing to tune
    _applied = ok
    if not ok:
        logger.info("mallopt unavailable; large CPU buffers will be re-faulted each step")
    return ok
