"""The n-gram proposer: which earlier occurrence it copies, and how much."""

from __future__ import annotations

import pytest

from engine_pod.spec_decode.config import SpeculativeConfig
from engine_pod.spec_decode.ngram_proposer import NgramProposer


def proposer(k=3, lo=1, hi=3):
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_longest_match_wins_over_a_more_recent_shorter_one():
    # Suffix [1, 2, 3]: the 3-gram occurred at the start (followed by 10, 11,
    # 12); only the 1-gram [3] occurred since (followed by 20).
    ctx = [1, 2, 3, 10, 11, 12, 3, 20, 1, 2, 3]
    assert proposer().propose(ctx) == [10, 11, 12]


def test_most_recent_occurrence_among_equally_long_matches():
    ctx = [5, 6, 40, 41, 42, 5, 6, 50, 51, 52, 5, 6]
    assert proposer(hi=2).propose(ctx) == [50, 51, 52]


def test_matches_longer_than_max_are_cut_to_max():
    # With max 2 the suffix [8, 9] matches both; the most recent wins,
    # although the older occurrence matches 4 tokens.
    ctx = [6, 7, 8, 9, 30, 31, 1, 8, 9, 40, 41, 6, 7, 8, 9]
    assert proposer(k=2, hi=2).propose(ctx) == [40, 41]
    assert proposer(k=2, hi=4).propose(ctx) == [30, 31]


def test_matches_shorter_than_min_propose_nothing():
    ctx = [1, 2, 60, 61, 9, 2]  # only the 1-gram [2] repeats
    assert proposer(lo=1).propose(ctx) == [60, 61, 9]
    assert proposer(lo=2).propose(ctx) == []


def test_no_earlier_occurrence_proposes_nothing():
    assert proposer().propose([1, 2, 3, 4, 5]) == []
    assert proposer().propose([7]) == []
    assert proposer().propose([]) == []


def test_k_caps_the_draft():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert proposer(k=1, hi=2).propose(ctx) == [3]
    assert proposer(k=5, hi=2).propose(ctx) == [3, 4, 5, 6, 7]


def test_a_continuation_running_into_the_suffix_repeats_the_period():
    # Period-2 loop: the latest [4, 5] is followed by only one known token
    # before the context ends, so the copy continues with the period.
    assert proposer(k=5, hi=2).propose([9, 4, 5, 4, 5]) == [4, 5, 4, 5, 4]
    assert proposer(k=4, hi=3).propose([3, 3, 3]) == [3, 3, 3, 3]


def test_matches_cover_the_prompt_start():
    # The earlier occurrence begins at index 0 (no out-of-range reads).
    assert proposer(k=2, hi=3).propose([1, 2, 3, 9, 8, 1, 2, 3]) == [9, 8]


@pytest.mark.parametrize("bad, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 1000}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": "3"}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ("{not json", "JSON"),
    ("[1, 2]", "JSON object"),
])
def test_bad_configs_name_the_field(bad, field):
    with pytest.raises(ValueError, match="speculative_config") as e:
        SpeculativeConfig.parse(bad)
    assert field in str(e.value)


def test_config_parses_json_and_fills_lookup_bounds_like_vllm():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 4, 4)
    c = SpeculativeConfig.parse({"num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse({}) is None
