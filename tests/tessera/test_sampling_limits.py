"""One home for the sampling limits (tessera/sampling_limits.py): the public
API's ranges lie within the engine's, so the engine never refuses what the
gateway admitted."""

from __future__ import annotations

import math

import pytest

from engine_pod import SamplingParams
from gateway.request import SamplingOptions
from tessera.sampling_limits import API_RANGES, ENGINE_RANGES, Range, check_range


@pytest.mark.parametrize("name", sorted(ENGINE_RANGES))
def test_every_api_range_lies_within_the_engines(name):
    assert API_RANGES[name].within(ENGINE_RANGES[name]), (name, API_RANGES[name], ENGINE_RANGES[name])


def _edges(r: Range) -> list[float]:
    """The values a range's bounds make interesting, in it or just outside."""
    values = []
    for bound in (r.low, r.high):
        if bound is not None:
            values += [bound, bound - 1e-9 if isinstance(bound, float) else bound - 1,
                       bound + 1e-9 if isinstance(bound, float) else bound + 1]
    return values


@pytest.mark.parametrize("name", sorted(ENGINE_RANGES))
def test_the_engine_takes_every_value_the_gateway_admits(name):
    for value in _edges(API_RANGES[name]) + _edges(ENGINE_RANGES[name]):
        if isinstance(ENGINE_RANGES[name].low, int) and not isinstance(value, int):
            continue
        options = SamplingOptions(**{name: value})
        try:
            options.validate()
        except ValueError as e:
            assert str(e).startswith(f"{name}: must be "), e
            continue
        extra = {"max_tokens": None} if name == "min_tokens" else {}
        SamplingParams(**{name: value}, **extra)  # raises if the engine refuses


@pytest.mark.parametrize("name", sorted(ENGINE_RANGES))
def test_the_engine_refuses_just_outside_its_range_naming_the_field(name):
    r = ENGINE_RANGES[name]
    step = 1 if isinstance(r.low, int) else 1e-6
    outside = [r.low - step if not r.low_open else r.low] if r.low is not None else []
    outside += [r.high + step] if r.high is not None else []
    for value in outside:
        with pytest.raises(ValueError, match=rf"^SamplingParams\.{name}: must be "):
            SamplingParams(**{name: value})


def test_range_text_and_nan():
    assert str(Range(0.0, 2.0)) == "in [0, 2]"
    assert str(Range(0.0, 1.0, low_open=True)) == "in (0, 1]"
    assert str(Range(1)) == ">= 1" and str(Range(0.0, low_open=True)) == "> 0"
    assert math.nan not in Range(0.0, 2.0) and math.nan not in Range()
    with pytest.raises(ValueError, match=r"^top_p: must be in \(0, 1\], got 0\.0$"):
        check_range("top_p", 0.0, API_RANGES)
    check_range("top_p", None, API_RANGES)


def test_pydantic_bounds_follow_the_range():
    assert Range(0.0, 2.0).pydantic() == {"ge": 0.0, "le": 2.0}
    assert Range(0.0, 1.0, low_open=True).pydantic() == {"gt": 0.0, "le": 1.0}
    assert Range(1).pydantic() == {"ge": 1}
