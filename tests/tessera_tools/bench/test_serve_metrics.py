"""`tessera bench serve`'s metric definitions on a recorded stream: fixed
(timestamp, event) lists for a few requests, with the expected figures
worked out by hand."""

from __future__ import annotations

import pytest

from tessera_tools.bench.serve.metrics import parse_percentiles, parse_slos, summarize
from tessera_tools.bench.serve.stream import DONE, replay


def text(t: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


def delta(finish: str | None = None, **fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}


def usage(prompt: int, completion: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


# Completions, sent at 0.0: four tokens, one of which decoded to "" (still a
# token: the choice is open), then the usage chunk and [DONE].
STREAM_A = (0.0, [(0.100, text("Hello")), (0.150, text(" world")), (0.230, text("")),
                  (0.250, text("!", "length")), (0.260, usage(10, 4)), (0.270, DONE)])
# Chat, sent at 0.5: a role-only opener and an empty closing chunk (neither is
# a token), no usage chunk: 2 counted tokens, the dataset's prompt length (7).
STREAM_B = (0.5, [(0.55, delta(role="assistant", content="")), (0.60, delta(content="Hi")),
                  (0.70, delta(content=" there")), (0.72, delta("stop")), (0.75, DONE)])
# One output token: no TPOT, no ITL.
STREAM_E = (1.0, [(1.05, text("x", "length")), (1.06, usage(3, 1)), (1.07, DONE)])
# Failures: an error event mid-stream, and a stream cut before [DONE].
STREAM_C = (0.2, [(0.25, text("a")), (0.30, {"error": {"message": "engine died", "code": 503}}), (0.31, DONE)])
STREAM_D = (0.3, [(0.40, text("a"))])


def outcomes():
    return [replay(*STREAM_A), replay(*STREAM_B, prompt_len=7), replay(*STREAM_C), replay(*STREAM_D),
            replay(*STREAM_E)]


def test_per_request_definitions():
    a, b, c, d, e = outcomes()
    assert a.ok and a.ttft_s == pytest.approx(0.100) and a.e2el_s == pytest.approx(0.270)
    assert a.itl_s == pytest.approx([0.050, 0.080, 0.020])
    assert (a.prompt_tokens, a.output_tokens) == (10, 4)  # from the usage chunk
    assert a.tpot_s == pytest.approx((0.270 - 0.100) / 3)

    assert b.ok and b.ttft_s == pytest.approx(0.10) and b.e2el_s == pytest.approx(0.25)
    assert b.itl_s == pytest.approx([0.10])
    assert (b.prompt_tokens, b.output_tokens) == (7, 2)  # counted chunks, dataset prompt length
    assert b.tpot_s == pytest.approx(0.15)

    assert e.ok and e.tpot_s is None and e.itl_s == [] and e.output_tokens == 1

    assert not c.ok and "engine died" in c.error
    assert not d.ok and "[DONE]" in d.error


def test_run_summary():
    s = summarize(outcomes(), duration_s=2.0, percentiles=[50, 99])
    assert (s["completed"], s["failed"]) == (3, 2)
    assert len(s["errors"]) == 2
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (20, 7)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(13.5)
    # TTFT [100, 100, 50] ms
    assert s["mean_ttft_ms"] == pytest.approx(250 / 3)
    assert s["median_ttft_ms"] == pytest.approx(100)
    assert s["p99_ttft_ms"] == pytest.approx(100)
    assert s["std_ttft_ms"] == pytest.approx((5000 / 9) ** 0.5)
    # ITL [50, 80, 20, 100] ms, pooled over requests; p99 interpolates 80..100.
    assert s["mean_itl_ms"] == pytest.approx(62.5)
    assert s["median_itl_ms"] == pytest.approx(65)
    assert s["p50_itl_ms"] == pytest.approx(65)
    assert s["p99_itl_ms"] == pytest.approx(80 + 0.97 * 20)
    # TPOT [56.67, 150] ms (E has one token: no TPOT).
    assert s["mean_tpot_ms"] == pytest.approx((170 / 3 + 150) / 2)
    assert s["p99_tpot_ms"] == pytest.approx(170 / 3 + 0.99 * (150 - 170 / 3))
    # E2E [270, 250, 70] ms
    assert s["median_e2el_ms"] == pytest.approx(250)
    assert s["p99_e2el_ms"] == pytest.approx(250 + 0.98 * 20)
    assert "request_goodput" not in s


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 90}, 1),  # only E (50 ms)
    ({"ttft": 120, "tpot": 100, "e2el": 300}, 2),  # A, and E (a 1-token output has TPOT 0); B's TPOT is 150
    ({"e2el": 260}, 2),  # B and E
    ({"tpot": 10}, 1),  # E
])
def test_goodput(slos, good):
    s = summarize(outcomes(), duration_s=2.0, percentiles=[99], slos=slos)
    assert s["request_goodput"] == pytest.approx(good / 2.0)
    assert s["goodput_slos_ms"] == slos


def test_all_failed_run_reports_without_values():
    s = summarize([replay(*STREAM_C)], duration_s=1.0, percentiles=[99], slos={"ttft": 100})
    assert (s["completed"], s["failed"], s["request_goodput"]) == (0, 1, 0)
    assert s["mean_ttft_ms"] is None and s["p99_itl_ms"] is None


def test_no_text_at_all_uses_the_first_choice():
    # Every token decoded to "" and the only chunk closes the choice.
    outcome = replay(0.0, [(0.2, text("", "length")), (0.3, usage(4, 1)), (0.31, DONE)])
    assert outcome.ok and outcome.ttft_s == pytest.approx(0.2) and outcome.output_tokens == 1


def test_slo_and_percentile_parsing():
    assert parse_slos(["ttft:500", "tpot:50.5", "e2el:3000"]) == {"ttft": 500, "tpot": 50.5, "e2el": 3000}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["ttft:0"]):
        with pytest.raises(ValueError, match="goodput SLO"):
            parse_slos(bad)
    assert parse_percentiles("50,90,99.9") == [50, 90, 99.9]
    for bad in ("", "x", "0,50", "100"):
        with pytest.raises(ValueError, match="percentiles"):
            parse_percentiles(bad)
