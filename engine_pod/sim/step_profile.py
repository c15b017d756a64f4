"""The step-time model of a simulated engine pod: one engine step's latency
as a linear function of what the step computes, fitted from real steps
(``tessera bench profile``) or derived from published figures.

Pure Python on purpose (no torch, no numpy): a simulated pod that imports
no torch reads and evaluates these profiles.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1

# The model's coefficients, in the order of StepFeatures.as_row() (base first).
COEFFICIENTS = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s", "per_kv_byte_s")
_FIELDS = ("format_version", *COEFFICIENTS, "source", "fitted_steps")


@dataclass(frozen=True)
class StepFeatures:
    """What one engine step computes, as the step-time model sees it."""

    num_prefill_tokens: int
    """Tokens computed in parallel: those of requests still in their prompt, and
    any past the first of a decoding request (draft verification)."""
    num_decode_seqs: int
    """Requests past their prompt that generate a token this step."""
    num_context_tokens: int
    """Tokens already in the KV cache that this step's requests attend to."""
    kv_bytes_moved: int = 0
    """KV bytes the step copies between the KV cache and the KV store (loads,
    saves, offloads), charged as if the copy did not overlap the compute."""

    def as_row(self) -> tuple[float, ...]:
        """The regression row: 1 for the base time, then each feature."""
        return (1.0, float(self.num_prefill_tokens), float(self.num_decode_seqs),
                float(self.num_context_tokens), float(self.kv_bytes_moved))


@dataclass
class StepTimeProfile:
    """seconds = base_s + per_prefill_token_s * p + per_decode_seq_s * d
    + per_context_token_s * c + per_kv_byte_s * b, every coefficient >= 0."""

    base_s: float
    """Fixed cost of a step (launch, sampling, bookkeeping), seconds."""
    per_prefill_token_s: float
    """Seconds per prefill token (StepFeatures.num_prefill_tokens)."""
    per_decode_seq_s: float
    """Seconds per decoding request (StepFeatures.num_decode_seqs)."""
    per_context_token_s: float
    """Seconds per cached token attended to (StepFeatures.num_context_tokens)."""
    per_kv_byte_s: float = 0.0
    """Seconds per KV byte moved (StepFeatures.kv_bytes_moved)."""
    source: str = ""
    """What it was fitted on (model, dtype, device, CPU, threads, date), or where its published figures come from."""
    fitted_steps: int = 0
    """How many real steps the fit used (0 for a profile from published figures)."""
    format_version: int = FORMAT_VERSION
    """The file format; loading refuses any other."""

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")

    def coefficients(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in COEFFICIENTS)

    def predict(self, features: StepFeatures) -> float:
        """The step's latency in seconds."""
        return sum(c * x for c, x in zip(self.coefficients(), features.as_row()))

    # -- files ------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in _FIELDS}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, origin: str = "<string>") -> StepTimeProfile:
        """Parse a profile; ValueError naming the field and ``origin`` (the file) on anything wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{origin}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{origin}: expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{origin}: unknown field(s) {', '.join(unknown)}")
        version = data.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise ValueError(f"{origin}: format_version: expected {FORMAT_VERSION}, got {version!r}")
        for name in COEFFICIENTS:
            if name not in data:
                raise ValueError(f"{origin}: {name}: missing")
        source, steps = data.get("source", ""), data.get("fitted_steps", 0)
        if not isinstance(source, str):
            raise ValueError(f"{origin}: source: expected a string, got {source!r}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"{origin}: fitted_steps: expected an integer >= 0, got {steps!r}")
        try:
            return cls(**{name: data[name] for name in COEFFICIENTS}, source=source, fitted_steps=steps)
        except ValueError as e:
            raise ValueError(f"{origin}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> StepTimeProfile:
        path = Path(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read the profile ({e})") from None
        return cls.from_json(text, origin=str(path))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())


# -- fitting ------------------------------------------------------------------------

def fit_profile(samples: Sequence[tuple[StepFeatures, float]], source: str) -> StepTimeProfile:
    """Least squares of the relative error over ``samples`` of (features,
    seconds), every coefficient >= 0. Relative, because steps span 100x in
    time and the error that matters is each step's own share (an absolute fit
    lets the long prefill steps decide and misses the many short decode ones).
    Features that never vary (or duplicate another) get 0."""
    if len(samples) < len(COEFFICIENTS):
        raise ValueError(f"samples: need at least {len(COEFFICIENTS)} steps to fit {len(COEFFICIENTS)} "
                         f"coefficients, got {len(samples)}")
    targets = [float(seconds) for _, seconds in samples]
    if any(not math.isfinite(t) or t <= 0 for t in targets):
        raise ValueError("samples: every step time must be a finite number > 0")
    rows = [[x / t for x in features.as_row()] for (features, _), t in zip(samples, targets)]
    base, prefill, decode, context, kv = nnls(rows, [1.0] * len(rows))
    return StepTimeProfile(base, prefill, decode, context, kv, source=source, fitted_steps=len(samples))


def nnls(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """argmin ||A x - y|| subject to x >= 0 (Lawson-Hanson active set), for
    a few columns: solved on the normal equations of unit-norm columns, so
    features of very different scales (bytes vs requests) condition alike."""
    ncols = len(rows[0])
    norms = [math.sqrt(sum(r[j] * r[j] for r in rows)) for j in range(ncols)]
    y_norm = math.sqrt(sum(t * t for t in targets))
    if y_norm == 0.0:
        return [0.0] * ncols
    live = [j for j in range(ncols) if norms[j] > 0.0]  # all-zero columns stay at 0
    cols = [[r[j] / norms[j] for r in rows] for j in live]
    y = [t / y_norm for t in targets]
    gram = [[_dot(a, b) for b in cols] for a in cols]
    rhs = [_dot(a, y) for a in cols]
    x = _active_set(gram, rhs)
    result = [0.0] * ncols
    for k, j in enumerate(live):
        result[j] = x[k] * y_norm / norms[j]
    return result


_GRADIENT_TOL = 1e-10


def _active_set(gram: list[list[float]], rhs: list[float]) -> list[float]:
    n = len(rhs)
    x = [0.0] * n
    passive: list[int] = []  # in the order they entered: a dependent late column gets 0
    for _ in range(10 * n + 10):  # terminates in exact arithmetic; the cap guards rounding
        gradient = [rhs[i] - _dot(gram[i], x) for i in range(n)]
        candidates = [i for i in range(n) if i not in passive and gradient[i] > _GRADIENT_TOL]
        if not candidates:
            break
        passive.append(max(candidates, key=lambda i: gradient[i]))
        while True:
            z = _solve_on(gram, rhs, passive)
            if all(z[i] > 0.0 for i in passive):
                x = z
                break
            # Step from x towards z as far as feasibility allows; drop the variables that hit 0.
            # (A dependent newcomer has x = z = 0: a zero step that drops it.)
            alpha = min(x[i] / (x[i] - z[i]) if x[i] > z[i] else 0.0 for i in passive if z[i] <= 0.0)
            x = [xi + alpha * (zi - xi) for xi, zi in zip(x, z)]
            passive = [i for i in passive if x[i] > 1e-15]
            for i in range(n):
                if i not in passive:
                    x[i] = 0.0
            if not passive:
                break
    return x


def _solve_on(gram: list[list[float]], rhs: list[float], idx: list[int]) -> list[float]:
    """The unconstrained least-squares solution on the columns ``idx``
    (Gauss-Jordan on their normal equations); a column that is (nearly) a
    combination of earlier ones gets 0 instead of breaking the solve."""
    m = len(idx)
    a = [[gram[i][j] for j in idx] + [rhs[i]] for i in idx]
    dependent = [False] * m
    for k in range(m):
        pivot = a[k][k]
        if pivot <= 1e-10:  # unit-norm columns: the part of column k outside the earlier ones
            dependent[k] = True
            for row in a:
                row[k] = 0.0
            a[k] = [0.0] * (m + 1)
            continue
        for i in range(m):
            if i != k and a[i][k] != 0.0:
                f = a[i][k] / pivot
                a[i] = [v - f * w for v, w in zip(a[i], a[k])]
    z = [0.0] * len(rhs)
    for k, i in enumerate(idx):
        z[i] = 0.0 if dependent[k] else a[k][m] / a[k][k]
    return z


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return math.fsum(u * v for u, v in zip(a, b))


def median_abs_pct_error(profile: StepTimeProfile, samples: Sequence[tuple[StepFeatures, float]]) -> float:
    """The median over ``samples`` of |predicted - actual| / actual (0.1 is 10%)."""
    errors = sorted(abs(profile.predict(f) - t) / t for f, t in samples if t > 0)
    if not errors:
        raise ValueError("samples: need at least one step with a time > 0")
    mid = len(errors) // 2
    return errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2
