"""The token bitmask the scheduler ships to the runner (no grammar state:
under tensor parallelism the workers only apply it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# All 32 bits set: every token of the word allowed.
ALL_ALLOWED = -1


@dataclass
class GrammarBitmask:
    """Row i of ``bitmask`` ([rows, ceil(vocab / 32)] int32, bit j of word w
    allows token 32 * w + j) is the next-token mask of request ``req_ids[i]``."""

    req_ids: list[str]
    bitmask: np.ndarray

    def rows_for(self, req_ids: list[str]) -> np.ndarray | None:
        """The masks in the runner's row order, all-allowed for requests
        without a grammar; None when none of them has one."""
        index = {r: i for i, r in enumerate(self.req_ids)}
        picks = [index.get(r, -1) for r in req_ids]
        if all(p < 0 for p in picks):
            return None
        rows = np.full((len(req_ids), self.bitmask.shape[1]), ALL_ALLOWED, dtype=np.int32)
        for row, pick in enumerate(picks):
            if pick >= 0:
                rows[row] = self.bitmask[pick]
        return rows
