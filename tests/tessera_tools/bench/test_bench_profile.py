"""`tessera bench profile` on tiny settings, through its parser and main:
it drives a real engine, fits, reports the held-back error and writes a
profile that loads."""

from __future__ import annotations

import argparse

from engine_pod.sim.step_profile import StepTimeProfile
from tessera_tools.bench import add_bench_parser


def test_a_small_profile_run_writes_a_loadable_profile(tiny_llama, tmp_path, capsys):
    root = argparse.ArgumentParser(prog="tessera")
    add_bench_parser(root.add_subparsers(dest="command"))
    output = tmp_path / "profiles" / "tiny.json"
    args = root.parse_args([
        "bench", "profile", "--model", str(tiny_llama), "--dtype", "float32", "--batch-sizes", "1,3",
        "--prompt-lens", "8,40", "--budgets", "16", "--decode-len", "3", "--kv-cache-gib", "0.01",
        "--output", str(output),
    ])
    assert args.bench_func(args) == 0
    printed = capsys.readouterr().out
    profile = StepTimeProfile.load(output)
    steps = int(printed.split(" steps: fitted on ")[0].rsplit("\n", 1)[-1])
    assert 0 < profile.fitted_steps < steps
    assert "held-back median absolute error" in printed
    assert f"model {tiny_llama.name}" in profile.source and "float32" in profile.source
    assert all(c >= 0 for c in profile.coefficients())
