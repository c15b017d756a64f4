"""The step-time model: a non-negative least-squares fit, and the profile
file that refuses anything wrong, naming the field and the file."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from engine_pod.sim.step_profile import (
    COEFFICIENTS, StepFeatures, StepTimeProfile, fit_profile, median_abs_pct_error, nnls,
)


def _features(rng, n, kv=False):
    return [StepFeatures(rng.randint(0, 2048), rng.randint(0, 64), rng.randint(0, 20000),
                         rng.randint(0, 10**9) if kv else 0) for _ in range(n)]


def _exact(profile_like, features):
    return [(f, sum(c * x for c, x in zip(profile_like, f.as_row()))) for f in features]


def test_fit_recovers_known_coefficients_from_exact_samples():
    true = (2e-3, 1e-4, 5e-4, 2e-6, 3e-11)
    samples = _exact(true, _features(random.Random(0), 60, kv=True))
    profile = fit_profile(samples, "synthetic")
    assert profile.coefficients() == pytest.approx(true, rel=1e-6)
    assert profile.fitted_steps == 60 and profile.source == "synthetic"
    assert median_abs_pct_error(profile, samples) < 1e-9


def test_nnls_clamps_a_coefficient_plain_least_squares_makes_negative():
    features = _features(random.Random(1), 40)
    # Time falls with decode sequences: plain least squares fits a negative coefficient.
    samples = _exact((1e-2, 1e-4, -1e-4, 0.0, 0.0), features)
    a = np.array([f.as_row()[:4] for f, _ in samples])
    y = np.array([t for _, t in samples])
    assert np.linalg.lstsq(a, y, rcond=None)[0][2] < 0
    got = nnls(a.tolist(), y.tolist())
    assert got[2] == 0.0
    # With it clamped the rest is the least-squares fit of the remaining columns.
    rest = np.linalg.lstsq(a[:, [0, 1, 3]], y, rcond=None)[0]
    assert (rest > 0).all()
    assert [got[0], got[1], got[3]] == pytest.approx(rest.tolist(), rel=1e-6, abs=1e-12)
    # fit_profile (relative errors) clamps it too.
    profile = fit_profile(samples, "s")
    assert profile.per_decode_seq_s == 0.0 and all(c >= 0 for c in profile.coefficients())


def test_constant_and_duplicate_columns_get_zero_without_breaking_the_solve():
    # kv bytes always 0, decode seqs always 3 (a copy of the base), context = 2 * prefill.
    samples = [(StepFeatures(p, 3, 2 * p), 1e-3 + 1e-4 * p) for p in range(1, 30)]
    profile = fit_profile(samples, "s")
    assert profile.per_kv_byte_s == 0.0
    assert all(math.isfinite(c) and c >= 0 for c in profile.coefficients())
    assert median_abs_pct_error(profile, samples) < 1e-9
    assert nnls([[0.0, 1.0]] * 5, [0.0] * 5) == [0.0, 0.0]


def test_fewer_samples_than_coefficients_is_refused():
    samples = _exact((1.0, 0, 0, 0, 0), _features(random.Random(2), len(COEFFICIENTS) - 1))
    with pytest.raises(ValueError, match="at least 5"):
        fit_profile(samples, "s")


def test_median_abs_pct_error():
    profile = StepTimeProfile(1.0, 0.0, 0.0, 0.0)
    f = StepFeatures(0, 0, 0)
    assert median_abs_pct_error(profile, [(f, 1.0), (f, 2.0), (f, 0.5)]) == pytest.approx(0.5)
    assert median_abs_pct_error(profile, [(f, 1.0), (f, 2.0)]) == pytest.approx(0.25)


def test_json_round_trip(tmp_path):
    profile = StepTimeProfile(1e-3, 2e-5, 3e-4, 4e-7, 5e-12, source="tiny on cpu", fitted_steps=12)
    assert StepTimeProfile.from_json(profile.to_json()) == profile
    path = tmp_path / "sub" / "p.json"
    profile.save(path)
    assert StepTimeProfile.load(path) == profile
    assert profile.predict(StepFeatures(10, 2, 100, 1000)) == pytest.approx(
        1e-3 + 10 * 2e-5 + 2 * 3e-4 + 100 * 4e-7 + 1000 * 5e-12)


def _good() -> dict:
    return json.loads(StepTimeProfile(1e-3, 2e-5, 3e-4, 4e-7, source="x", fitted_steps=9).to_json())


def _broken(**change):
    data = _good()
    for key, value in change.items():
        if value is _DROP:
            data.pop(key)
        else:
            data[key] = value
    return json.dumps(data)


_DROP = object()


@pytest.mark.parametrize("text, field", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (_broken(format_version=2), "format_version"),
    (_broken(format_version=_DROP), "format_version"),
    (_broken(per_decode_seq_s=_DROP), "per_decode_seq_s: missing"),
    (_broken(base_s=-1e-3), "base_s"),
    (_broken(per_context_token_s=float("nan")), "per_context_token_s"),
    (_broken(per_context_token_s="1e-3"), "per_context_token_s"),
    (_broken(per_prefill_token_s=float("inf")), "per_prefill_token_s"),
    (_broken(per_kv_byte_s=None), "per_kv_byte_s"),
    (_broken(per_kv_byte_s=True), "per_kv_byte_s"),
    (_broken(fitted_steps=-1), "fitted_steps"),
    (_broken(source=3), "source"),
    (_broken(per_token_s=1.0), "unknown field(s) per_token_s"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)
def test_a_bad_file_is_refused_naming_the_field_and_the_file(tmp_path, text, field):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        StepTimeProfile.load(path)
    assert field in str(err.value) and str(path) in str(err.value), err.value


def test_a_missing_file_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="nope.json"):
        StepTimeProfile.load(tmp_path / "nope.json")


def test_a_negative_coefficient_is_refused_in_code_too():
    with pytest.raises(ValueError, match="per_decode_seq_s"):
        StepTimeProfile(1.0, 0.0, -1.0, 0.0)


def _brute_force_nnls(a, y):
    """The NNLS optimum by enumeration: the best least-squares fit over
    column subsets whose unconstrained solution is non-negative."""
    best, best_x = float("inf"), np.zeros(a.shape[1])
    for mask in range(1, 2 ** a.shape[1]):
        cols = [j for j in range(a.shape[1]) if mask >> j & 1]
        sol = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        if (sol < 0).any():
            continue
        x = np.zeros(a.shape[1])
        x[cols] = sol
        residual = float(np.linalg.norm(a @ x - y))
        if residual < best:
            best, best_x = residual, x
    return best_x


# Seed 49 makes a column that entered the active set turn negative when a later one enters:
# the step back to feasibility (an unconstrained solve there gives -0.008).
@pytest.mark.parametrize("seed", [49, 0, 1, 2, 3, 4])
def test_nnls_matches_enumeration_on_correlated_columns(seed):
    rng = np.random.default_rng(seed)
    n = 20
    a = np.abs(rng.normal(0, 1, (n, 4)) + rng.normal(0, 1, (n, 1)) * 2)
    y = a @ rng.normal(0, 1, 4) + rng.normal(0, 0.1, n)
    got = nnls(a.tolist(), y.tolist())
    want = _brute_force_nnls(a, y)
    assert min(got) >= 0
    assert got == pytest.approx(want.tolist(), rel=1e-6, abs=1e-9)
