"""`tessera bench prefix-cache --peer vllm` without vLLM: the figures as pure functions, and the
command end to end with the real engine on the tiny checkpoint against the stand-in `vllm`
package of test_vllm_peer.py (what this cannot show: that the real vLLM's stats still carry
`first_token_latency`; the benchmark run in docs/benchmarks.md shows it)."""

from __future__ import annotations

import json

import pytest

from tessera_tools.bench.peer_prefix_cache import summarize, vllm_figures
from tessera_tools.bench.peers.vllm_peer import PeerRun
from tessera_tools.bench.workload import BenchRequest

from .conftest import HARMLESS_LIBRARY


def test_vllms_figures_are_tesseras_and_a_short_output_or_missing_ttft_is_refused():
    requests = [BenchRequest([1] * 8, 2), BenchRequest([1] * 8, 3)]
    run = PeerRun(seconds=2.0, token_ids=[[1, 2], [1, 2, 3]], cached_tokens=[0, 8], ttft_s=[0.5, 0.1])
    assert vllm_figures(run, requests) == {"seconds": 2.0, "tokens_per_second": 2.5, "mean_ttft_s": 0.3,
                                           "cached_prompt_tokens": 8}
    with pytest.raises(RuntimeError, match="produced 4 tokens, expected 5"):
        vllm_figures(PeerRun(2.0, [[1, 2], [1, 2]], [0, 0], [0.5, 0.1]), requests)
    with pytest.raises(RuntimeError, match="no TTFT per request"):
        vllm_figures(PeerRun(2.0, [[1, 2], [1, 2, 3]], [0, 8], [0.5, None]), requests)


def test_the_ratios_are_of_medians_and_above_one_where_tessera_is_ahead():
    def fig(tps, ttft):
        return {"tokens_per_second": tps, "mean_ttft_s": ttft, "cached_prompt_tokens": 10}

    s = summarize({"tessera": [fig(300, 1.0), fig(100, 3.0), fig(200, 2.0)],
                   "vllm": [fig(100, 4.0), fig(400, 1.0), fig(160, 3.0)]})
    assert s["medians"]["tessera"]["tokens_per_second"] == 200 and s["medians"]["vllm"]["mean_ttft_s"] == 3.0
    assert s["throughput_ratio_tessera_over_vllm"] == pytest.approx(1.25)
    assert s["mean_ttft_ratio_vllm_over_tessera"] == pytest.approx(1.5)


def test_the_command_runs_both_workloads_on_both_sides_with_caching_on(fake_vllm, tiny_llama, tmp_path,
                                                                      monkeypatch):
    from tessera_tools.bench.peers import vllm_peer
    from tessera_tools.cli import main

    venv, record = fake_vllm
    monkeypatch.setenv("TESSERA_VLLM_VENV", str(venv))
    monkeypatch.setattr(vllm_peer, "TCMALLOC", HARMLESS_LIBRARY)
    out = tmp_path / "report.json"
    code = main(["bench", "prefix-cache", "--model", str(tiny_llama), "--dtype", "float32", "--num-requests", "4",
                 "--prefix-len", "48", "--suffix-len", "4", "--output-len", "3", "--unique-requests", "3",
                 "--rounds", "2", "--kv-cache-gib", "1", "--peer", "vllm", "--output", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    for workload in ("shared_prefix", "no_shared_prefix"):
        rounds = report[workload]["rounds"]
        assert len(rounds["tessera"]) == len(rounds["vllm"]) == 2
        medians = report[workload]["medians"]
        assert report[workload]["throughput_ratio_tessera_over_vllm"] == pytest.approx(
            medians["tessera"]["tokens_per_second"] / medians["vllm"]["tokens_per_second"])
    # The tiny engine serves the shared prefix from its cache: every request after the first hits it.
    assert report["shared_prefix"]["medians"]["tessera"]["cached_prompt_tokens"] >= 3 * 32
    assert report["parity_shared_prefix"]["requests"] == 4
    seen = json.loads(record.read_text())["settings"]
    assert seen["enable_prefix_caching"] is True and seen["disable_log_stats"] is False
