"""`tessera bench spec` end to end on the tiny checkpoint: every engine emits
the same tokens (the command raises otherwise) and the report holds each
side's figures."""

from __future__ import annotations

import json

from tessera_tools.cli import main


def test_spec_bench_runs_and_reports_each_side(tiny_llama, tmp_path):
    out = tmp_path / "spec.json"
    rc = main(["bench", "spec", "--model", str(tiny_llama), "--dtype", "float32", "--threads", "1", "--k", "2",
               "--rounds", "1", "--num-requests", "2", "--passage-len", "8", "--output-len", "64",
               "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    for scenario in ("one_at_a_time", "batch"):
        off, spec = report[scenario]["off"], report[scenario]["k=2"]
        assert off["steps"] > spec["steps"] > 0  # drafts were accepted, so fewer steps
        assert spec["mean_accepted_length"] > 1.0 and off["acceptance_rate"] == 0.0
