"""`tessera bench throughput --peer vllm` without vLLM: the worker and its parent over their
JSON-lines protocol against a stand-in `vllm` package (the worker's only import), in a real
child process; the figures and the parity check as pure functions. The real vLLM runs only
in the benchmark (`make vllm-venv`): what these cannot show is that vLLM's own API still
takes these arguments."""

from __future__ import annotations

import json

import pytest

from tessera_tools.bench.peer_throughput import comparison, parity
from tessera_tools.bench.peers.vllm_peer import VLLMPeer, VLLMSettings
from tessera_tools.bench.workload import BenchRequest

from .conftest import HARMLESS_LIBRARY

def _settings(**overrides) -> VLLMSettings:
    fields = {"model": "/models/bench", "dtype": "float32", "max_num_seqs": 256, "max_num_batched_tokens": 2048,
              "enable_prefix_caching": False, "seed": 0, "max_model_len": 2048, "kv_cache_gib": 4, "cpus": "0-1"}
    return VLLMSettings(**{**fields, **overrides})


def test_the_peer_generates_the_requests_with_vllms_cpu_setup(fake_vllm, tmp_path):
    venv, record = fake_vllm
    requests = [BenchRequest([1, 2, 3], 4), BenchRequest([7] * 10, 2)]
    with VLLMPeer(_settings(), log_path=tmp_path / "vllm.log", venv=venv, tcmalloc=HARMLESS_LIBRARY) as peer:
        run = peer.generate(requests, timeout_s=30)
        assert peer.version == "0.0-fake"
    assert run.token_ids == [[6, 7, 8, 9], [70, 71]] and run.seconds >= 0
    assert run.cached_tokens == [1, 5] and run.ttft_s == [None, None], "no stats unless asked for"
    seen = json.loads(record.read_text())
    assert seen["settings"] == {"model": "/models/bench", "dtype": "float32", "max_num_seqs": 256,
                                "max_num_batched_tokens": 2048, "enable_prefix_caching": False, "seed": 0,
                                "max_model_len": 2048, "disable_log_stats": True}
    assert seen["env"] == {"LD_PRELOAD": f"{HARMLESS_LIBRARY} {venv / 'lib' / 'libiomp5.so'}",
                           "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert seen["tessera_vars"] == [], "no Tessera variable (the internal secret) reaches the peer"
    assert "a log line on stdout" in (tmp_path / "vllm.log").read_text()


def test_a_profiled_generate_runs_the_engine_in_the_workers_process_and_returns_its_operators(fake_vllm):
    venv, record = fake_vllm
    with VLLMPeer(_settings(in_process=True), venv=venv, tcmalloc=HARMLESS_LIBRARY) as peer:
        run, operators = peer.profile([BenchRequest([1, 2, 3], 4)], timeout_s=30)
    assert run.token_ids == [[6, 7, 8, 9]] and isinstance(operators, list)
    assert all(len(op) == 3 for op in operators)
    assert json.loads(record.read_text())["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_a_hung_or_dead_peer_ends_with_a_clear_error(fake_vllm):
    venv, _ = fake_vllm
    with VLLMPeer(_settings(), venv=venv, tcmalloc=HARMLESS_LIBRARY) as peer:
        with pytest.raises(TimeoutError, match="no answer to generate within 1 s"):
            peer.generate([BenchRequest([1], 999)], timeout_s=1)
    with VLLMPeer(_settings(), venv=venv, tcmalloc=HARMLESS_LIBRARY) as peer:
        with pytest.raises(RuntimeError, match="vLLM exited with 3 during generate"):
            peer.generate([BenchRequest([1], 998)], timeout_s=30)


def test_a_missing_environment_or_library_is_named(fake_vllm, tmp_path):
    venv, _ = fake_vllm
    with pytest.raises(FileNotFoundError, match="make vllm-venv"):
        VLLMPeer(_settings(), venv=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="apt-get install libtcmalloc-minimal4"):
        VLLMPeer(_settings(), venv=venv, tcmalloc=tmp_path / "no-tcmalloc.so")
    assert not any(p.name == "record.json" for p in tmp_path.iterdir()), "nothing was started"


def test_parity_counts_exact_matches_and_where_the_others_diverge():
    ours = [[1, 2, 3], [1, 2, 3], [1, 2], [4]]
    theirs = [[1, 2, 3], [1, 9, 3], [1, 2, 5], [4]]
    assert parity(ours, theirs) == {"requests": 4, "exact_matches": 2, "tokens_compared": 9,
                                    "first_divergence": [None, 1, 2, None]}


def test_the_figure_is_the_ratio_of_the_medians():
    c = comparison([300.0, 100.0, 200.0], [100.0, 400.0, 160.0])
    assert (c["tessera_median"], c["vllm_median"]) == (200.0, 160.0)
    assert c["ratio_of_medians"] == pytest.approx(1.25)


def test_the_command_alternates_rounds_and_reports_the_ratio_and_parity(fake_vllm, tiny_llama, tmp_path, monkeypatch):
    """`tessera bench throughput --peer vllm` end to end on the tiny checkpoint, the stand-in peer in its
    place: Tessera's side is the real engine."""
    from tessera_tools.bench.peers import vllm_peer
    from tessera_tools.cli import main

    venv, record = fake_vllm
    monkeypatch.setenv("TESSERA_VLLM_VENV", str(venv))
    monkeypatch.setattr(vllm_peer, "TCMALLOC", HARMLESS_LIBRARY)
    out = tmp_path / "report.json"
    code = main(["bench", "throughput", "--model", str(tiny_llama), "--dtype", "float32", "--num-requests", "6",
                 "--max-prompt-len", "40", "--max-output-len", "8", "--kv-cache-gib", "1", "--peer", "vllm",
                 "--rounds", "2", "--parity-requests", "4", "--output", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    rounds = report["rounds"]
    assert len(rounds["tessera_tokens_per_second"]) == len(rounds["vllm_tokens_per_second"]) == 2
    assert rounds["ratio_of_medians"] == pytest.approx(rounds["tessera_median"] / rounds["vllm_median"])
    assert report["parity"]["requests"] == 4 and report["peer"]["settings"]["dtype"] == "float32"
    assert json.loads(record.read_text())["settings"]["model"] == str(tiny_llama)


@pytest.mark.parametrize("cpus, ok", [("0-1", True), ("0,2-3", True), ("3", True), ("1-0", False), ("a", False),
                                      ("0-", False), ("", False), ("0;rm", False)])
def test_the_peers_cores_are_checked_before_anything_starts(cpus, ok):
    import argparse

    from tessera_tools.bench.flags import cpu_list

    if ok:
        assert cpu_list(cpus) == cpus
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="expected cores like 0-1"):
            cpu_list(cpus)


def test_with_log_stats_the_peer_reports_each_requests_ttft(fake_vllm):
    venv, record = fake_vllm
    with VLLMPeer(_settings(log_stats=True, enable_prefix_caching=True), venv=venv, tcmalloc=HARMLESS_LIBRARY) as peer:
        run = peer.generate([BenchRequest([1, 2, 3, 4], 2)], timeout_s=30)
    assert run.ttft_s == [0.25] and run.cached_tokens == [2]
    assert json.loads(record.read_text())["settings"]["disable_log_stats"] is False
