"""What several benchmarks share besides their flags (flags.py) and figures
(stats.py): the checkpoint they serve, the order of alternating rounds, the
markdown tables they print and the JSON report they write."""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

# The checkpoint benchmarks serve when given none (built once, deterministic).
DEFAULT_TINY = Path(".cache/bench-models/tiny")

T = TypeVar("T")


def resolve_model(path: str | None) -> Path:
    """The checkpoint to serve: `path`, or the tiny preset built once into
    .cache (make-model is deterministic, so a cached copy is exact)."""
    if path:
        return Path(path)
    if not (DEFAULT_TINY / "model.safetensors").is_file():
        from tessera_tools.fixtures import make_model

        tmp = DEFAULT_TINY.with_suffix(".tmp")
        make_model("tiny", tmp)
        tmp.rename(DEFAULT_TINY)
    return DEFAULT_TINY


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """`items` starting at a different one each round (two items: swapped
    every other round), so drift in the machine's load favours none of the
    sides a benchmark compares."""
    k = round_index % len(items)
    return [*items[k:], *items[:k]]


@contextlib.contextmanager
def work_dir(logs: str | None, prefix: str) -> Iterator[Path]:
    """The folder for a run's pod and gateway logs: --logs (kept), else a
    temporary one removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(logs or tmp)
        work.mkdir(parents=True, exist_ok=True)
        yield work


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "---") -> str:
    """A table ready for docs/benchmarks.md; `align` is the separator cell
    ("---:" right-aligns numbers)."""
    lines = ["| " + " | ".join(header) + " |", "|" + f" {align} |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _strict(value):
    """NaN and infinity are not JSON: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def write_report(report: dict, path: str | Path | None) -> Path | None:
    """Write `report` as strict JSON (NaN and infinity as null) to `path`,
    creating its folder, and say where; nothing when `path` is None (the
    --output flag not given)."""
    if path is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_strict(report), indent=2, allow_nan=False))
    print(f"\nwrote {path}")
    return path
