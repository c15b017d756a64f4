"""Keep glibc from returning big freed buffers to the OS on every step, and
put the big long-lived buffers (weights, KV cache) on 2 MiB pages.

Each forward allocates and frees tens of megabytes of activations and
gathered KV. By default glibc serves such sizes with mmap and unmaps them
on free, so the next step pays a page fault per 4 KiB again: on a 2-core CPU
that was 3x the cost of the gathers themselves. Raising the mmap and trim
thresholds keeps those buffers in the heap for reuse (what tcmalloc or
jemalloc would give through LD_PRELOAD, without another dependency).

Every step streams all the weights and decode attention reads KV blocks
scattered over gigabytes; with 4 KiB pages much of that traffic also pays
TLB misses and page walks. Linux's transparent huge pages, where set to
"madvise" (a common default), back only the memory asked for: the KV cache
is advised before it is first written, and the heap that holds the packed
weights is collapsed into huge pages once they are loaded. On the bench
model that measured 3% more throughput (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_HUGE_PAGE = 2 << 20
_applied = False


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _whole_huge_pages(lo: int, hi: int) -> tuple[ctypes.c_void_p, ctypes.c_size_t] | None:
    """madvise's (address, length) for the 2 MiB pages wholly inside [lo, hi), or None."""
    start, end = -(-lo // _HUGE_PAGE) * _HUGE_PAGE, hi // _HUGE_PAGE * _HUGE_PAGE
    return (ctypes.c_void_p(start), ctypes.c_size_t(end - start)) if end > start else None


def keep_freed_memory_in_heap(threshold_bytes: int = 1 << 30) -> bool:
    global _applied
    if _applied:
        return True
    try:
        libc = _libc()
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


def advise_huge_pages(tensor) -> bool:
    """Ask Linux to back `tensor`'s memory with 2 MiB pages where it is not touched yet
    (call it before the first write; pages already faulted in stay small).

    Decode attention reads every sequence's KV blocks, scattered over gigabytes: with 4 KiB
    pages nearly each block costs a TLB miss and a page walk on top of the memory latency.
    Only the whole 2 MiB pages inside the tensor are advised. False where the kernel or libc
    refuses (no transparent huge pages, not Linux): the tensor is unchanged either way."""
    span = _whole_huge_pages(tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size())
    if span is None:
        return False
    try:
        return _libc().madvise(*span, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def collapse_heap_to_huge_pages() -> int:
    """Back the process heap (where the packed weights live, see keep_freed_memory_in_heap) with
    2 MiB pages now: MADV_HUGEPAGE for its later faults, MADV_COLLAPSE (Linux 6.1+) for the pages
    already there. Returns the bytes advised (0 where Linux or libc refuse; nothing changes then)."""
    try:
        with open("/proc/self/maps") as maps:
            heaps = [line.split()[0] for line in maps if line.rstrip().endswith("[heap]")]
        libc = _libc()
    except (OSError, AttributeError):
        return 0
    advised = 0
    for heap in heaps:
        span = _whole_huge_pages(*(int(x, 16) for x in heap.split("-")))
        if span is not None and libc.madvise(*span, _MADV_HUGEPAGE) == 0:
            advised += span[1].value
            libc.madvise(*span, _MADV_COLLAPSE)  # best effort: khugepaged gets there later otherwise
    return advised
