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

    def rows_for(self, req_ids: list[str], num_rows: list[int]) -> np.ndarray | None:
        """The masks in the runner's row order, ``num_rows[i]`` rows for
        ``req_ids[i]`` (1 + its drafts under speculative decoding; a
        request's rows here are contiguous and as many), all-allowed for
        requests without a grammar; None when none of them has one."""
        first: dict[str, int] = {}
        for i, req_id in enumerate(self.req_ids):
            first.setdefault(req_id, i)
        if not any(r in first for r in req_ids):
            return None
        rows = np.full((sum(num_rows), self.bitmask.shape[1]), ALL_ALLOWED, dtype=np.int32)
        out = 0
        for req_id, n in zip(req_ids, num_rows):
            if req_id in first:
                rows[out : out + n] = self.bitmask[first[req_id] : first[req_id] + n]
            out += n
        return rows
