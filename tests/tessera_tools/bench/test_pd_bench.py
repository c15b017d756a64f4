"""`tessera bench pd` end to end on the tiny checkpoint: three set-ups (two
mixed pods; prefill + decode over Redis; prefill + decode pushing directly)
serve the same short prompts, and the pods' counters show each set-up moved
the KV the way it claims. Then the checks and the refusals, without pods."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tessera_tools.bench.pd_report import checks, hand_off
from tessera_tools.cli import main

REQUESTS, ROUNDS, PROMPT, OUTPUT = 3, 2, 64, 4
# Full blocks of a 64-token prompt a decode pod loads: the last token is always computed there.
BLOCKS_PER_PROMPT = (PROMPT - 1) // 16


def _children() -> set[int]:
    """This process's live child processes (pods, gateways, Redis servers)."""
    me, out = str(os.getpid()), set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[1] == me and fields[0] != "Z":
            out.add(int(entry.name))
    return out


@pytest.fixture(scope="module")
def report(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-pd")
    before = _children()
    rc = main(["bench", "pd", "--model", str(tiny_llama), "--dtype", "float32", "--prompt-tokens", str(PROMPT),
               "--output-tokens", str(OUTPUT), "--requests", str(REQUESTS), "--rounds", str(ROUNDS),
               "--warmup", "1", "--min-uncached-tokens", "32", "--kv-cache-mib", "32", "--inbox-mib", "32",
               "--logs", str(tmp / "logs"), "--out", str(tmp / "pd.json")])
    assert rc == 0
    # Every pod, gateway and Redis the command started has exited.
    assert _children() <= before
    return json.loads((tmp / "pd.json").read_text())


def test_every_set_up_reports_its_latencies_and_ratios(report, capsys):
    (entry,) = report["results"]
    assert entry["tp"] == 1 and list(entry["modes"]) == ["mixed", "redis", "direct"]
    assert report["problems"] == []
    for mode, result in entry["modes"].items():
        assert (result["completed"], result["failed"]) == (REQUESTS * ROUNDS, 0), mode
        for name in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "e2e_p50_ms", "goodput_rps"):
            assert result["median"][name] > 0, (mode, name)
        assert len(result["rounds"]) == ROUNDS
        # Each computing pod saw every prompt new: no prefix-cache hits, in any set-up or round.
        assert result["hand_off"]["computing_pods_prefix_hit_tokens"] == 0, mode
    # The order rotates: a set-up that ran first in round 1 does not in round 2.
    first = [[m for m, r in entry["modes"].items() if r["rounds"][i]["position"] == 0] for i in range(ROUNDS)]
    assert first == [["mixed"], ["redis"]]
    for name in ("direct/redis", "redis/mixed"):
        assert len(entry["ratios"][name]["per_round"]) == ROUNDS and entry["ratios"][name]["median"] > 0


def test_direct_pushes_into_the_inbox_and_redis_goes_through_redis(report):
    modes = report["results"][0]["modes"]
    disaggregated = REQUESTS * ROUNDS
    direct, redis, mixed = modes["direct"]["hand_off"], modes["redis"]["hand_off"], modes["mixed"]["hand_off"]
    assert direct["prefilled_requests"] == redis["prefilled_requests"] == disaggregated
    assert (direct["pushes_ok"], direct["pushes_fallback"], direct["pushes_failed"]) == (disaggregated, 0, 0)
    assert (direct["pushes_socket"], direct["pushes_grpc"]) == (disaggregated, 0)  # the decode pod's inbox socket
    assert direct["decode_hits_inbox"] == disaggregated * BLOCKS_PER_PROMPT and direct["decode_hits_redis"] == 0
    assert direct["transfer_bytes_direct"] > 0 and direct["transfer_bytes_redis"] == 0
    assert redis["decode_hits_redis"] == disaggregated * BLOCKS_PER_PROMPT and redis["decode_hits_inbox"] == 0
    assert redis["transfer_bytes_redis"] == direct["transfer_bytes_direct"]  # the same blocks, either way
    assert redis["pushes_ok"] == redis["transfer_bytes_direct"] == 0
    assert mixed["prefilled_requests"] == 0 and mixed["decode_hits_redis"] == 0


def test_the_table_has_a_row_per_set_up(report, capsys):
    from tessera_tools.bench.pd_report import ratio_lines, table

    text = table(report["results"])
    rows = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["mixed", "redis", "direct"]
    assert ratio_lines(report["results"])[0].startswith("TP=1: TTFT p50 direct/redis ")


def _result(**hand) -> dict:
    prefill = {"pod_requests": 4, "pushes/ok": 4, "push_paths/socket": 4, "transfer_bytes/direct": 1.0}
    base = hand_off({"prefill": prefill, "decode": {"store_hits/inbox": 12, "store_lookups": 12}})
    return {"failed": 0, "hand_off": {**base, **hand}}


def test_checks_name_what_contradicts_a_set_up():
    assert checks("direct", _result(), 4) == []
    assert checks("direct", _result(pushes_fallback=1), 4) == ["direct: pushes ok 4, fallback 1, failed 0"]
    assert checks("direct", _result(decode_hits_redis=3), 4) == ["direct: decode pod hits inbox 12, redis 3"]
    assert checks("direct", _result(pushes_socket=3), 4) == ["direct: 3 of 4 pushes took the socket path"]
    assert checks("direct", _result(decode_lookups=20), 4) == [
        "direct: the decode pod found 12 of the 20 blocks it looked up (the rest were recomputed)"]
    assert checks("direct-grpc", _result(), 4) == ["direct-grpc: 0 of 4 pushes took the grpc path"]
    assert checks("direct-grpc", _result(pushes_socket=0, pushes_grpc=4), 4) == []
    assert checks("direct", _result(prefilled_requests=3), 4) == [
        "direct: 3 of 4 requests were prefilled on the prefill pod"]
    assert checks("redis", _result(pushes_ok=0, decode_hits_inbox=0, decode_hits_redis=12), 4) == []
    assert "redis: decode pod hits redis 0" in checks("redis", _result(), 4)[0]
    assert checks("mixed", {"failed": 2, "hand_off": {**_result()["hand_off"],
                                                      "computing_pods_prefix_hit_tokens": 16}}, 4) == [
        "mixed: 2 request(s) failed",
        "mixed: the pods computing prompts found 16 prompt tokens in their prefix cache (every prompt was "
        "meant to be new)"]


@pytest.mark.parametrize("extra, message", [
    (["--prompt-tokens", "2040", "--output-tokens", "16"], "exceed the model's 2048 positions"),
    (["--prompt-tokens", "100", "--min-uncached-tokens", "128"], "would not disaggregate"),
    (["--simulate", "p.json", "--tp", "1,2"], "leave --tp at 1 and --dtype at auto"),
    (["--simulate", "p.json", "--dtype", "float32"], "leave --tp at 1 and --dtype at auto"),
])
def test_settings_that_cannot_run_are_refused_before_anything_starts(tiny_llama, extra, message, capsys):
    assert main(["bench", "pd", "--model", str(tiny_llama), *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_model_is_refused(tmp_path, capsys):
    assert main(["bench", "pd", "--model", str(tmp_path / "nowhere")]) == 2
    assert "make bench-models" in capsys.readouterr().err


def test_simulated_pods_of_a_shape_only_model_move_its_kv_each_way(tmp_path, fast_sim_profile):
    """--simulate on a model written without weights (make-model's shape-only
    presets): the real stores and channels carry the model's block size, and
    the checks confirm each set-up's path."""
    from tessera_tools.fixtures.make_model import PRESETS, ModelPreset, make_model

    shape = ModelPreset(**{**PRESETS["tiny"].__dict__, "shape_only": True})
    model = make_model(shape, tmp_path / "shape-only")
    assert not list(model.glob("*.safetensors"))
    out = tmp_path / "pd.json"
    assert main(["bench", "pd", "--model", str(model), "--simulate", str(fast_sim_profile), "--modes",
                 "redis,direct,direct-grpc", "--prompt-tokens", str(PROMPT), "--output-tokens", str(OUTPUT),
                 "--requests", "2", "--rounds", "1", "--warmup", "0", "--min-uncached-tokens", "32",
                 "--kv-cache-mib", "32", "--inbox-mib", "32", "--redis-mib", "64", "--kv-redis-timeout", "2",
                 "--logs", str(tmp_path / "logs"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["problems"] == [] and report["settings"]["simulate"] == str(fast_sim_profile)
    modes = report["results"][0]["modes"]
    assert modes["direct"]["hand_off"]["pushes_socket"] == modes["direct-grpc"]["hand_off"]["pushes_grpc"] == 2
    assert modes["redis"]["hand_off"]["decode_hits_redis"] == 2 * BLOCKS_PER_PROMPT
