"""The sampler and its logit processors on small hand-made logits.

Expectations are derived from the definitions (vLLM semantics):
- top-k keeps the k largest logits of a row, the rest become -inf;
- top-p keeps the smallest set of most likely tokens whose probability
  reaches p (the most likely token always stays), on the top-k-filtered,
  renormalised distribution;
- min-p drops tokens whose probability is below min_p * max probability;
- repetition penalty divides positive / multiplies negative logits of tokens
  seen in the prompt or the output; frequency subtracts count * f and
  presence subtracts p once, for output tokens only.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_pod.sample.metadata import SamplingMetadata
from engine_pod.sample.ops import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    random_sample,
)
from engine_pod.sample.sampler import Sampler

NEG_INF = float("-inf")


def _kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def _logits_from_probs(probs, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(probs, dtype=dtype).log()


def _md(
    temperature,
    *,
    top_k=None,
    top_p=None,
    min_p=None,
    generators=None,
    penalties=None,
    min_tokens_mask=None,
    max_num_logprobs=None,
) -> SamplingMetadata:
    temps = torch.tensor(temperature, dtype=torch.float32)
    md = SamplingMetadata(
        temperature=temps,
        all_greedy=bool((temps == 0).all()),
        all_random=bool((temps > 0).all()),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        generators=generators or {},
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        output_token_ids=None,
        prompt_token_mask=None,
        min_tokens_mask=min_tokens_mask,
        max_num_logprobs=max_num_logprobs,
    )
    if penalties is not None:
        for name, value in penalties.items():
            setattr(md, name, value)
    return md


# -- top-k -------------------------------------------------------------------

def test_top_k_keeps_exactly_the_k_largest_per_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 10, dtype=torch.float64)
    ks = [1, 3, 7]
    out = apply_top_k_top_p(logits, torch.tensor(ks), None)
    for row, k in enumerate(ks):
        expected = set(logits[row].topk(k).indices.tolist())
        assert _kept(out[row]) == expected
        # kept logits are unchanged, the others are -inf
        for t in range(10):
            if t in expected:
                assert out[row, t] == logits[row, t]
            else:
                assert out[row, t] == NEG_INF


def test_top_k_equal_to_vocab_disables_it():
    logits = torch.tensor([[0.1, -2.0, 3.0, 0.5], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    out = apply_top_k_top_p(logits, torch.tensor([4, 2]), None)
    assert torch.equal(out[0], logits[0])
    assert _kept(out[1]) == {2, 3}


# -- top-p -------------------------------------------------------------------

@pytest.mark.parametrize(
    "p, expected",
    [
        (0.3, {0}),          # the most likely token always stays
        (0.49, {0}),
        (0.7, {0, 1}),       # 0.5 < 0.7 <= 0.8
        (0.79, {0, 1}),
        # p = 0.8 exactly is left out: 0.5 + 0.3 == 0.8 is a tie that floating
        # point rounding (of 1 - p, or of the softmax) decides either way.
        (0.7999, {0, 1}),
        (0.8001, {0, 1, 2}),
        (0.81, {0, 1, 2}),   # 0.8 < 0.81 <= 0.95
        (0.9, {0, 1, 2}),
        (0.96, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(p, expected):
    # Shuffled order, so the result does not depend on token ids being sorted.
    probs = [0.15, 0.5, 0.05, 0.3]
    perm = [1, 3, 0, 2]  # token ids of 0.5, 0.3, 0.15, 0.05
    logits = _logits_from_probs([probs]).clone()
    out = apply_top_k_top_p(logits, None, torch.tensor([p], dtype=torch.float64))
    assert _kept(out[0]) == {perm[i] for i in expected}


def test_top_p_per_row_and_kept_logits_unchanged():
    logits = _logits_from_probs([[0.5, 0.3, 0.15, 0.05]] * 3)
    out = apply_top_k_top_p(logits, None, torch.tensor([0.4, 0.75, 1.0], dtype=torch.float64))
    assert _kept(out[0]) == {0}
    assert _kept(out[1]) == {0, 1}
    assert _kept(out[2]) == {0, 1, 2, 3}
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = _logits_from_probs([[0.4, 0.3, 0.2, 0.1]])
    # Without top-k, p=0.5 needs 0.4 + 0.3.
    alone = apply_top_k_top_p(logits, None, torch.tensor([0.5], dtype=torch.float64))
    assert _kept(alone[0]) == {0, 1}
    # With k=2 the distribution is (4/7, 3/7): 4/7 already reaches 0.5.
    both = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5], dtype=torch.float64))
    assert _kept(both[0]) == {0}


# -- min-p -------------------------------------------------------------------

def test_min_p_drops_below_fraction_of_max_prob_per_row():
    logits = _logits_from_probs([[0.05, 0.5, 0.15, 0.3]] * 4)
    out = apply_min_p(logits, torch.tensor([0.0, 0.2, 0.4, 0.9], dtype=torch.float64))
    assert _kept(out[0]) == {0, 1, 2, 3}
    assert _kept(out[1]) == {1, 2, 3}      # threshold 0.1
    assert _kept(out[2]) == {1, 3}         # threshold 0.2
    assert _kept(out[3]) == {1}            # threshold 0.45
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])


def test_min_p_one_keeps_only_the_maximum():
    logits = torch.tensor([[1.0, 3.0, 2.9, -1.0]], dtype=torch.float64)
    out = apply_min_p(logits, torch.tensor([1.0], dtype=torch.float64))
    assert _kept(out[0]) == {1}


# -- penalties ---------------------------------------------------------------

def _reference_penalties(logits, prompt_ids, output_ids, presence, frequency, repetition):
    out = logits.clone()
    for r in range(logits.shape[0]):
        counts = {}
        for t in output_ids[r]:
            counts[t] = counts.get(t, 0) + 1
        seen = set(prompt_ids[r]) | set(counts)
        for t in range(logits.shape[1]):
            v = logits[r, t].item()
            if t in seen:
                v = v / repetition[r] if v > 0 else v * repetition[r]
            v -= frequency[r] * counts.get(t, 0)
            v -= presence[r] * (1 if counts.get(t, 0) > 0 else 0)
            out[r, t] = v
    return out


def _penalty_inputs(prompt_ids, output_ids, vocab):
    rows = len(prompt_ids)
    prompt_mask = torch.zeros(rows, vocab, dtype=torch.bool)
    for r, ids in enumerate(prompt_ids):
        prompt_mask[r, ids] = True
    width = max(1, max(len(o) for o in output_ids))
    out = torch.full((rows, width), vocab, dtype=torch.int64)  # padded with vocab
    for r, ids in enumerate(output_ids):
        out[r, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return prompt_mask, out


def test_penalties_match_the_definition():
    logits = torch.tensor(
        [[2.0, -1.0, 0.5, -0.5, 3.0, 1.0], [2.0, -1.0, 0.5, -0.5, 3.0, 1.0], [1.0, 1.0, 1.0, -1.0, -1.0, 0.0]],
        dtype=torch.float64,
    )
    prompt_ids = [[0, 1], [2], [5]]
    output_ids = [[2, 2, 3], [], [0, 0, 0, 4]]
    presence, frequency, repetition = [0.5, 1.0, 0.0], [0.25, 0.0, 0.5], [2.0, 1.5, 1.0]
    prompt_mask, out_ids = _penalty_inputs(prompt_ids, output_ids, 6)
    got = apply_penalties(
        logits, prompt_mask, out_ids,
        torch.tensor(presence, dtype=torch.float64), torch.tensor(frequency, dtype=torch.float64),
        torch.tensor(repetition, dtype=torch.float64),
    )
    want = _reference_penalties(logits, prompt_ids, output_ids, presence, frequency, repetition)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_repetition_penalty_covers_prompt_and_output_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0]], dtype=torch.float64)
    prompt_mask, out_ids = _penalty_inputs([[0, 1]], [[2, 3]], 5)
    zero = torch.zeros(1, dtype=torch.float64)
    got = apply_penalties(logits, prompt_mask, out_ids, zero, zero, torch.tensor([4.0], dtype=torch.float64))
    # prompt tokens 0, 1 and output tokens 2, 3 are penalised; 4 is untouched
    assert got[0].tolist() == [0.5, -8.0, 0.5, -8.0, 2.0]


def test_frequency_and_presence_ignore_prompt_tokens():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    prompt_mask, out_ids = _penalty_inputs([[0, 1, 1, 1]], [[1, 2, 2, 2]], 4)
    one = torch.ones(1, dtype=torch.float64)
    got = apply_penalties(
        logits, prompt_mask, out_ids,
        torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.25], dtype=torch.float64), one,
    )
    # token 0: prompt only -> unchanged; token 1: once in output -> 1 - 0.25 - 0.5;
    # token 2: three times in output -> 1 - 0.75 - 0.5; token 3: unseen.
    assert got[0].tolist() == pytest.approx([1.0, 0.25, -0.25, 1.0])


def test_no_penalty_rows_are_bit_identical():
    torch.manual_seed(1)
    logits = torch.randn(2, 50, dtype=torch.float64)
    prompt_mask, out_ids = _penalty_inputs([[1, 2, 3], [4, 5]], [[6, 6, 7], [8]], 50)
    got = apply_penalties(
        logits, prompt_mask, out_ids,
        torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64),
        torch.tensor([1.0, 1.3], dtype=torch.float64),
    )
    assert torch.equal(got[0], logits[0])
    assert not torch.equal(got[1], logits[1])


# -- random sampling ---------------------------------------------------------

def test_random_sample_seeded_is_reproducible():
    probs = torch.softmax(torch.randn(1, 100, dtype=torch.float64), dim=-1)

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return [random_sample(probs, {0: g}).item() for _ in range(50)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_seeded_row_ignores_the_rest_of_the_batch():
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(4, 64, dtype=torch.float64), dim=-1)
    g_alone, g_batch = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    g_other = torch.Generator().manual_seed(99)
    for _ in range(30):
        alone = random_sample(probs[2:3], {0: g_alone}).item()
        batch = random_sample(probs, {2: g_batch, 0: g_other})
        assert batch[2].item() == alone


def test_random_sample_follows_the_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64)
    draws = [random_sample(probs, {0: g}).item() for _ in range(2000)]
    freq = [draws.count(t) / len(draws) for t in range(3)]
    # 4 standard deviations of a binomial proportion at n = 2000 is < 0.041.
    for f, p in zip(freq, [0.7, 0.2, 0.1]):
        assert abs(f - p) < 0.041, freq


def test_random_sample_unseeded_rows_follow_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64).expand(2000, 3).contiguous()
    draws = random_sample(probs, {}).tolist()
    freq = [draws.count(t) / len(draws) for t in range(3)]
    for f, p in zip(freq, [0.7, 0.2, 0.1]):
        assert abs(f - p) < 0.041, freq


def test_zero_probability_tokens_are_never_sampled():
    torch.manual_seed(0)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]], dtype=torch.float64).expand(1000, 5).contiguous()
    draws = set(random_sample(probs, {}).tolist())
    assert draws == {1, 3}


# -- the Sampler -------------------------------------------------------------

def test_temperature_zero_rows_are_greedy_among_random_rows():
    torch.manual_seed(0)
    vocab = 200
    logits = torch.randn(4, vocab, dtype=torch.float64) * 0.1  # flat: random rows rarely pick the argmax
    md = _md([0.0, 1.0, 0.0, 1.0])
    sampler = Sampler()
    random_hits_argmax = 0
    for _ in range(20):
        out = sampler(logits, md)
        assert out.sampled[0].item() == logits[0].argmax().item()
        assert out.sampled[2].item() == logits[2].argmax().item()
        random_hits_argmax += int(out.sampled[1].item() == logits[1].argmax().item())
    assert random_hits_argmax < 20  # the random rows really are random


def test_all_greedy_batch_is_argmax():
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, -1.0, 1.9]], dtype=torch.float64)
    out = Sampler()(logits, _md([0.0, 0.0]))
    assert out.sampled.tolist() == [1, 0]
    assert out.logprobs is None


def test_sampler_temperature_scales_the_distribution():
    torch.manual_seed(0)
    n = 3000
    logits = _logits_from_probs([[0.7, 0.2, 0.1]]).expand(n, 3).contiguous()
    out = Sampler()(logits, _md([0.5] * n))
    draws = out.sampled.tolist()
    # temperature 0.5 squares the probabilities: (0.49, 0.04, 0.01) / 0.54
    expected = [0.49 / 0.54, 0.04 / 0.54, 0.01 / 0.54]
    for t, p in enumerate(expected):
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(draws.count(t) / n - p) < 4 * sd + 1e-3


def test_sampler_respects_top_k_per_row():
    torch.manual_seed(0)
    rows, vocab = 3, 50
    logits = torch.randn(rows, vocab, dtype=torch.float64)
    md = _md([1.0] * rows, top_k=[1, 5, vocab])
    sampler = Sampler()
    seen = [set() for _ in range(rows)]
    for _ in range(200):
        for r, t in enumerate(sampler(logits, md).sampled.tolist()):
            seen[r].add(t)
    assert seen[0] == {logits[0].argmax().item()}
    assert seen[1] <= set(logits[1].topk(5).indices.tolist())
    assert len(seen[2]) > 5  # disabled: the support is the whole vocabulary


def test_sampler_min_tokens_mask_bans_tokens_even_for_greedy():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, False, False]])
    out = Sampler()(logits, _md([0.0], min_tokens_mask=mask))
    assert out.sampled.tolist() == [2]


def test_sampler_applies_penalties_before_greedy():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]], dtype=torch.float64)
    prompt_mask, out_ids = _penalty_inputs([[1]], [[]], 4)
    md = _md(
        [0.0],
        penalties=dict(
            presence_penalty=torch.zeros(1), frequency_penalty=torch.zeros(1),
            repetition_penalty=torch.tensor([2.0]), prompt_token_mask=prompt_mask, output_token_ids=out_ids,
        ),
    )
    assert Sampler()(logits, md).sampled.tolist() == [2]  # 5 / 2 < 4


def test_sampler_logprobs_are_raw_with_sampled_first_and_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 4.0]], dtype=torch.float64)
    # Row 0 greedy but its top token is banned, so it samples token 2 (rank 2).
    mask = torch.tensor([[False, True, False, False], [False, False, False, False]])
    out = Sampler()(logits, _md([0.0, 0.0], min_tokens_mask=mask, max_num_logprobs=2))
    raw = logits.log_softmax(dim=-1)
    assert out.sampled.tolist() == [2, 3]
    assert out.logprob_token_ids.tolist() == [[2, 1, 2], [3, 3, 0]]
    torch.testing.assert_close(out.logprobs[0], raw[0, [2, 1, 2]])
    torch.testing.assert_close(out.logprobs[1], raw[1, [3, 3, 0]])
    assert out.sampled_ranks.tolist() == [2, 1]
