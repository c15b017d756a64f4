"""The helpers the benchmarks share: the one percentile definition (numpy's
linear interpolation), best-of-N timing, the order of alternating rounds,
the markdown table and the JSON report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tessera_tools.bench.common import markdown_table, rotated, work_dir, write_report
from tessera_tools.bench.stats import best_of, percentile


@pytest.mark.parametrize("values", [[3.0], [5.0, 1.0], [50, 80, 20, 100], list(range(101)), [0.3, 7.1, 2.2, 2.2, 9.9]])
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_is_numpys_linear_interpolation(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_edges():
    assert percentile([50, 80, 20, 100], 99) == pytest.approx(80 + 0.97 * 20)  # interpolates, not a rank
    assert percentile([4, 1, 3], 50) == 3  # p50 is the median
    assert math.isnan(percentile([], 50))
    assert percentile(iter([2.0, 1.0]), 100) == 2.0
    for q in (-1, 100.5):
        with pytest.raises(ValueError, match="between 0 and 100"):
            percentile([1.0], q)


def test_best_of_warms_up_then_keeps_the_fastest():
    calls = []
    assert best_of(lambda: calls.append(1), 3) >= 0
    assert len(calls) == 4  # one untimed call, three timed
    with pytest.raises(ValueError, match="repeats"):
        best_of(lambda: None, 0)


def test_rotated_rounds():
    assert [rotated(("a", "b"), r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert [rotated([0, 2, 4], r) for r in range(4)] == [[0, 2, 4], [2, 4, 0], [4, 0, 2], [0, 2, 4]]


def test_markdown_table():
    table = markdown_table(("a", "b"), [[1, "x"], ["", 2.5]], align="---:")
    assert table.splitlines() == ["| a | b |", "| ---: | ---: |", "| 1 | x |", "|  | 2.5 |"]


def test_write_report_is_strict_json_and_optional(tmp_path, capsys):
    assert write_report({"a": 1}, None) is None
    path = write_report({"nan": math.nan, "inf": [math.inf, (1.0, -math.inf)], "ok": {"x": 2.5}},
                        tmp_path / "sub" / "r.json")
    assert json.loads(path.read_text()) == {"nan": None, "inf": [None, [1.0, None]], "ok": {"x": 2.5}}
    assert f"wrote {path}" in capsys.readouterr().out


def test_work_dir_keeps_logs_only_when_asked(tmp_path):
    with work_dir(str(tmp_path / "logs"), "t-") as kept:
        assert kept == tmp_path / "logs" and kept.is_dir()
    assert kept.is_dir()
    with work_dir(None, "t-") as temporary:
        assert temporary.is_dir()
    assert not temporary.exists()
