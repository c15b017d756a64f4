"""The engine pod's CPU thread count follows its cgroup quota."""

from __future__ import annotations

import os

from engine_pod.server.cpu_share import cpu_share

CORES = len(os.sched_getaffinity(0))


def test_no_cgroup_files_means_the_affinity(tmp_path):
    assert cpu_share(tmp_path) == CORES


def test_cgroup_v2_quota_caps_and_rounds_up(tmp_path):
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert cpu_share(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_share(tmp_path) == CORES
    (tmp_path / "cpu.max").write_text(f"{(CORES + 8) * 100000} 100000\n")  # above the affinity
    assert cpu_share(tmp_path) == CORES


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_share(tmp_path) == CORES
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert cpu_share(tmp_path) == 1
