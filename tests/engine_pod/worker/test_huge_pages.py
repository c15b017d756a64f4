"""The CPU engine's memory on 2 MiB pages (engine_pod/worker/cpu_malloc.py): the KV cache advised
before it is zeroed, the heap that holds the packed weights collapsed once they are loaded. Checked
in /proc/self/smaps, where Linux reports each mapping's huge pages."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from engine_pod.model.hf_config import load_arch_config
from engine_pod.worker.cpu_malloc import advise_huge_pages, collapse_heap_to_huge_pages
from engine_pod.worker import kv_cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off on this machine"
)


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@needs_thp
def test_an_advised_tensor_is_faulted_in_as_huge_pages():
    # Fresh private memory: a heap buffer may have been touched before (and a shared map is not anonymous).
    region = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.uint8)
    assert advise_huge_pages(t)
    t.fill_(1)
    assert huge_bytes_at(t.data_ptr() + (8 << 20)) >= 2 << 20
    del t
    region.close()


def test_a_tensor_without_a_whole_huge_page_is_left_alone():
    assert not advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))


def test_the_cpu_kv_cache_is_advised_before_it_is_zeroed(tiny_llama, monkeypatch):
    advised = []

    def spy(tensor):
        advised.append((tensor.data_ptr(), tensor.numel(), bool(tensor.any()) if tensor.numel() < (1 << 26) else None))
        return True

    monkeypatch.setattr(kv_cache, "advise_huge_pages", spy)
    cfg = load_arch_config(tiny_llama)
    cache = kv_cache.allocate_kv_caches(cfg, num_blocks=64, block_size=16, dtype=torch.float32,
                                        device=torch.device("cpu"))
    assert advised and advised[0][:2] == (cache.data_ptr(), cache.numel())
    assert not cache.any()  # zeroed after the advice


@needs_thp
def test_collapsing_the_heap_keeps_its_contents():
    before = torch.randn(4 << 20)  # 16 MiB, in the heap or a mapping of its own: its values must survive
    copy = before.clone()
    assert collapse_heap_to_huge_pages() > 0
    assert torch.equal(before, copy)
