"""`tessera tune`: the search's pruning on a scripted goodput curve, and the
command end to end on the tiny model (a two-point search of real `tessera
up` platforms under load), with every bad input refused before anything
starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tessera_tools.cli import main
from tessera_tools.tune.knobs import Knob, check_mode, default_knobs, parse_knob, with_settings
from tessera_tools.tune.report import engine_patch
from tessera_tools.tune.search import Trial, best_of, search
from tessera_tools.tune.slo import misses, parse_slo, per_request_bounds


def _resource(max_num_seqs: int = 1) -> dict:
    return {"apiVersion": "tessera.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "tuned", "namespace": "default"},
            "spec": {"model": {"name": "tiny", "pvc": {"claimName": "models", "path": "tiny"}, "dtype": "float32",
                               "maxModelLen": 512},
                     "mode": "mixed", "engine": {"maxNumSeqs": max_num_seqs, "maxNumBatchedTokens": 512},
                     "pools": {"mixed": {"replicas": 1}}}}


@pytest.fixture
def models_dir(tiny_llama, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny").symlink_to(tiny_llama)
    return models


def _write(tmp_path, resource: dict):
    path = tmp_path / "inferenceservice.yaml"
    path.write_text(yaml.safe_dump(resource))
    return path


def test_slos_parse_and_judge_a_summary():
    slo = parse_slo("e2el:p99:500")
    assert (slo.metric, slo.percentile, slo.bound_ms, slo.summary_key) == ("e2el", 99.0, 500.0, "p99_e2el_ms")
    assert per_request_bounds([slo, parse_slo("e2el:p50:200"), parse_slo("itl:p90:40")]) == {"e2el": 200.0}
    assert misses([slo], {"failed": 0, "p99_e2el_ms": 499.0}) == []
    assert misses([slo], {"failed": 2, "p99_e2el_ms": 612.4}) == ["2 requests failed", "e2el p99 612 ms > 500 ms"]
    for bad in ("e2el:99:500", "latency:p99:500", "e2el:p100:500", "e2el:p99:0", "e2el:p99"):
        with pytest.raises(ValueError, match="SLO"):
            parse_slo(bad)


def test_the_search_walks_each_knob_and_stops_past_the_peak():
    """Goodput peaks at maxNumSeqs 16 whatever the token budget, and a little at 1024 tokens."""
    seqs = Knob("maxNumSeqs", (1, 2, 4, 8, 16, 32, 64, 128, 256))
    tokens = Knob("maxNumBatchedTokens", (256, 512, 1024, 2048))
    calls = []

    def evaluate(settings):
        calls.append(settings)
        s, t = settings["maxNumSeqs"], settings["maxNumBatchedTokens"]
        goodput = 10 - abs(s.bit_length() - 5) - 0.1 * abs(t.bit_length() - 11)
        return Trial(settings, goodput, meets=s <= 64)

    trials = search([seqs, tokens], {"maxNumSeqs": 256, "maxNumBatchedTokens": 2048}, evaluate)
    assert best_of(trials).settings == {"maxNumSeqs": 16, "maxNumBatchedTokens": 1024}
    assert len(calls) == len({tuple(sorted(c.items())) for c in calls})  # no setting twice
    assert len(trials) < len(seqs.values) * len(tokens.values)  # pruned: 32 and 64 end the walk past 16
    assert {"maxNumSeqs": 128, "maxNumBatchedTokens": 2048} not in calls


def test_knobs_parse():
    assert parse_knob("maxNumSeqs=32,8,16") == Knob("maxNumSeqs", (8, 16, 32))
    assert parse_knob("maxNumBatchedTokens").values == (512, 1024, 2048, 4096)
    for bad, match in (("maxLoras=1", "not one this tuner searches"), ("maxNumSeqs=a", "INT"),
                       ("maxNumSeqs=0,4", "positive")):
        with pytest.raises(ValueError, match=match):
            parse_knob(bad)


def test_pool_sizes_are_knobs_of_a_disaggregated_service_only():
    resource = {"spec": {"mode": "disaggregated", "engine": {"maxNumSeqs": 64}, "pools": {"prefill": {"replicas": 1}}}}
    tuned = with_settings(resource, {"prefillReplicas": 2, "decodeReplicas": 3, "maxNumSeqs": 16})
    assert tuned["spec"]["pools"] == {"prefill": {"replicas": 2}, "decode": {"replicas": 3}}
    assert tuned["spec"]["engine"] == {"maxNumSeqs": 16}
    assert resource["spec"]["pools"] == {"prefill": {"replicas": 1}}  # a copy: the input is untouched
    assert engine_patch({"decodeReplicas": 2, "maxNumSeqs": 8}) == {
        "spec": {"pools": {"decode": {"replicas": 2}}, "engine": {"maxNumSeqs": 8}}}
    assert [k.name for k in default_knobs("mixed")] == ["maxNumSeqs", "maxNumBatchedTokens"]
    assert [k.name for k in default_knobs("disaggregated")][2:] == ["prefillReplicas", "decodeReplicas"]
    check_mode([parse_knob("decodeReplicas=1,2")], "disaggregated")
    with pytest.raises(ValueError, match="only a disaggregated service has it"):
        check_mode([parse_knob("decodeReplicas=1,2")], "mixed")


@pytest.mark.parametrize("argv, resource, message", [
    (["--knob", "prefillReplicas=1,2"], _resource(), "only a disaggregated service has it"),
    (["--knob", "maxLoras=1,2"], _resource(), "not one this tuner searches"),
    (["--slo", "e2el:p99"], _resource(), "expected METRIC:pNN:MS"),
    (["--request-rates", "4,2"], _resource(), "ascending"),
    (["--simulate", "no-such-profile.json"], _resource(), "no such profile"),
    ([], _resource(max_num_seqs=0), "maxNumSeqs"),
    (["--ready-timeout", "0"], _resource(), "must be a number > 0"),
    (["--ready-timeout", "nan"], _resource(), "must be a number > 0"),
])
def test_bad_inputs_exit_2_before_anything_starts(tmp_path, models_dir, capsys, argv, resource, message):
    try:
        rc = main(["tune", "-f", str(_write(tmp_path, resource)), "--models-dir", str(models_dir),
                   "--slo", "e2el:p99:60000", *argv, "--output-dir", str(tmp_path / "out")])
    except SystemExit as e:  # a flag's own type refuses it (argparse)
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


SIM_PROFILE = Path(__file__).resolve().parents[3] / "engine_pod" / "sim" / "profiles" / "bench-cpu.json"
TUNE = ["--request-rates", "4", "--num-prompts", "8", "--max-prompt-len", "48", "--max-output-len", "8",
        "--ready-timeout", "120"]


def test_a_two_point_search_end_to_end(tmp_path, models_dir):
    out = tmp_path / "out"
    rc = main(["tune", "-f", str(_write(tmp_path, _resource())), "--models-dir", str(models_dir), *TUNE,
               "--slo", "e2el:p99:60000", "--knob", "maxNumSeqs=1,4", "--output-dir", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert [t["settings"]["maxNumSeqs"] for t in report["trials"]] == [1, 4]
    for trial in report["trials"]:
        (run,) = trial["rates"]
        assert trial["meets_slos"] and run["completed"] == 8 and run["failed"] == 0 and trial["goodput"] > 0
    patch = yaml.safe_load((out / "patch.yaml").read_text())
    assert patch == {"spec": {"engine": {"maxNumSeqs": report["best"]["settings"]["maxNumSeqs"]}}}
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    assert tuned["spec"]["engine"]["maxNumBatchedTokens"] == 512 and tuned["metadata"]["name"] == "tuned"
    assert (out / "goodput_vs_maxNumSeqs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_fleet_of_simulated_pods(tmp_path, models_dir):
    """Fleet-scale questions run on simulated pods (no model compute): four
    replicas, one setting (the search over settings is the test above's)."""
    resource = _resource(max_num_seqs=4)
    resource["spec"]["pools"]["mixed"]["replicas"] = 4
    out = tmp_path / "out"
    rc = main(["tune", "-f", str(_write(tmp_path, resource)), "--models-dir", str(models_dir), *TUNE,
               "--simulate", str(SIM_PROFILE), "--slo", "e2el:p99:60000", "--knob", "maxNumSeqs=4",
               "--output-dir", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    (trial,) = report["trials"]
    assert trial["settings"]["maxNumSeqs"] == 4
    assert trial["meets_slos"] and trial["rates"][0]["completed"] == 8


def test_an_slo_no_setting_meets_exits_1_saying_so(tmp_path, models_dir, capsys):
    rc = main(["tune", "-f", str(_write(tmp_path, _resource())), "--models-dir", str(models_dir), *TUNE,
               "--slo", "ttft:p50:0.01", "--knob", "maxNumSeqs=1", "--output-dir", str(tmp_path / "out")])
    assert rc == 1
    err = capsys.readouterr().err
    assert "no setting tried met ttft p50 <= 0.01 ms" in err
    assert json.loads((tmp_path / "out" / "report.json").read_text())["met"] is False
