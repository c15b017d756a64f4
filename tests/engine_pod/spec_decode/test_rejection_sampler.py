"""The rejection sampler: greedy verification is exact, and sampling
verification emits tokens distributed as the processed target distribution.

Statistical tests use many identical requests in one call with a fixed
seed, and Pearson's chi-square against the exact target probabilities,
compared with the 0.1% critical value of its degrees of freedom.
"""

from __future__ import annotations

import torch

from engine_pod.sample.metadata import SamplingMetadata
from engine_pod.spec_decode.rejection_sampler import PAD, RejectionSampler

# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
N = 100_000


def metadata(temps, top_k=None, top_p=None, min_p=None, generators=None) -> SamplingMetadata:
    t = torch.tensor(temps, dtype=torch.float64)
    return SamplingMetadata(
        temperature=t, all_greedy=bool((t == 0).all()), all_random=bool((t > 0).all()),
        top_k=None if top_k is None else torch.tensor(top_k), top_p=None if top_p is None else torch.tensor(top_p),
        min_p=None if min_p is None else torch.tensor(min_p), generators=generators or {},
        presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
        output_token_ids=None, prompt_token_mask=None, min_tokens_mask=None, max_num_logprobs=None,
    )


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(samples, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0, "sampled a token with zero target probability"
    support = probs > 0
    expected = probs[support] * len(samples)
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def run_one_draft(logits, draft, temperature, seed=0, **filters):
    """N requests, each with one draft; rows: [target after the verified
    token, target after the draft]. Returns emitted [N, 2]."""
    torch.manual_seed(seed)
    rows = logits.repeat(N, 1)
    per_row = {k: [v] * (2 * N) for k, v in filters.items()}
    md = metadata([temperature] * (2 * N), **per_row)
    return RejectionSampler()(rows, md, [[draft]] * N)


LOGITS = torch.tensor([[1.0, 2.0, 0.5, -1.0, 0.0, 1.5], [0.3, -0.2, 2.2, 0.0, 1.0, -3.0]], dtype=torch.float64)


def test_sampled_tokens_follow_the_target_with_a_likely_draft():
    temperature = 0.8
    target = (LOGITS / temperature).softmax(-1)
    out = run_one_draft(LOGITS, draft=1, temperature=temperature)
    stat, df = chi_square(out[:, 0], target[0])
    assert stat < CHI2_CRIT[df], stat
    accepted = out[:, 0] == 1
    # Accepted with probability p(draft); then the bonus follows row 1.
    assert abs(accepted.double().mean() - target[0, 1]) < 0.02
    stat, df = chi_square(out[accepted, 1], target[1])
    assert stat < CHI2_CRIT[df], stat
    assert (out[~accepted, 1] == PAD).all()


def test_sampled_tokens_follow_the_target_when_the_draft_is_mostly_rejected():
    target = LOGITS.softmax(-1)
    out = run_one_draft(LOGITS, draft=3, temperature=1.0, seed=1)  # p(3) ~ 0.02
    assert (out[:, 0] == 3).double().mean() < 0.04
    stat, df = chi_square(out[:, 0], target[0])
    assert stat < CHI2_CRIT[df], stat


def test_a_draft_outside_top_k_is_never_accepted_and_the_output_stays_in_top_k():
    # top-k 3 keeps tokens 1, 5, 0; the draft 4 has zero probability.
    out = run_one_draft(LOGITS, draft=4, temperature=1.0, seed=2, top_k=3)
    kept = torch.full_like(LOGITS[0], float("-inf"))
    kept[[1, 5, 0]] = LOGITS[0, [1, 5, 0]]
    target = kept.softmax(-1)
    assert not (out[:, 0] == 4).any()
    stat, df = chi_square(out[:, 0], target)
    assert df == 2 and stat < CHI2_CRIT[df], stat


def test_top_p_and_min_p_shape_the_target_as_in_the_sampler():
    # min_p 0.2 of the top probability and top_p 0.8: the sampler's rules.
    from engine_pod.sample.ops import apply_temperature_and_truncation

    t = torch.tensor([0.7], dtype=torch.float64)
    target = apply_temperature_and_truncation(
        LOGITS[:1], t, torch.tensor([0.2], dtype=torch.float64), None, torch.tensor([0.8], dtype=torch.float64)
    ).softmax(-1)[0]
    out = run_one_draft(LOGITS, draft=5, temperature=0.7, seed=3, top_p=0.8, min_p=0.2)
    stat, df = chi_square(out[:, 0], target)
    assert 0 < target[5] < 1 and stat < CHI2_CRIT[df], stat


def test_greedy_rows_accept_the_argmax_prefix_then_correct_or_add_a_bonus():
    # Rows: A (3 drafts) 0-3, B (2 drafts) 4-6, C (1 draft) 7-8.
    argmax = [3, 4, 5, 1, 6, 7, 8, 9, 2]
    logits = torch.zeros(9, 10, dtype=torch.float64)
    logits[range(9), argmax] = 1.0
    # A: drafts [3, 4, 0] -> accepts 3, 4, then 5 replaces the 0.
    # B: drafts [6, 7] -> both accepted, bonus 8. C: [0] -> 9 replaces it.
    out = RejectionSampler()(logits, metadata([0.0] * 9), [[3, 4, 0], [6, 7], [0]])
    assert out.tolist() == [[3, 4, 5, PAD], [6, 7, 8, PAD], [9, PAD, PAD, PAD]]


def test_greedy_and_sampling_requests_in_one_call():
    logits = torch.full((4, 6), -30.0, dtype=torch.float64)
    logits[[0, 1, 2, 3], [2, 3, 1, 4]] = 5.0  # near point masses
    out = RejectionSampler()(logits, metadata([0.0, 0.0, 1.0, 1.0]), [[2], [1]])
    assert out.tolist() == [[2, 3], [1, 4]]


def test_a_seeded_request_draws_the_same_whatever_else_is_in_the_batch():
    def run(extra_rows):
        logits = torch.cat([LOGITS, torch.randn(extra_rows, 6, dtype=torch.float64)])
        g = torch.Generator().manual_seed(123)
        drafts = [[1]] + [[0]] * (extra_rows // 2)
        md = metadata([1.0] * len(logits), generators={0: g, 1: g})
        return RejectionSampler()(logits, md, drafts)[0].tolist()

    torch.manual_seed(0)
    alone = run(0)
    torch.manual_seed(99)
    assert run(6) == alone
