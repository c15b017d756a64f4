"""Where the logits rows of one step lie when some requests carry drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecDecodeMetadata:
    # Per sampling request, in logits order: its scheduled drafts ([]: none).
    draft_token_ids: list[list[int]]
    # First logits row of each sampling request (it has len(drafts) + 1).
    row_starts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        counts = np.array([len(d) + 1 for d in self.draft_token_ids], dtype=np.int64)
        self.row_starts = np.cumsum(counts) - counts

    @property
    def max_num_drafts(self) -> int:
        return max(len(d) for d in self.draft_token_ids)

    @property
    def plain(self) -> list[int]:
        """Requests without drafts: sampled by the plain sampler."""
        return [i for i, d in enumerate(self.draft_token_ids) if not d]

    @property
    def speculative(self) -> list[int]:
        """Requests with drafts: verified by the rejection sampler."""
        return [i for i, d in enumerate(self.draft_token_ids) if d]

    def plain_rows(self) -> np.ndarray:
        return self.row_starts[self.plain]

    def speculative_rows(self) -> np.ndarray:
        return np.concatenate(
            [np.arange(self.row_starts[i], self.row_starts[i] + len(self.draft_token_ids[i]) + 1)
             for i in self.speculative]
        )

    @staticmethod
    def logits_indices(last_token: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
        """Flat batch positions whose logits are needed: each sampling
        request's last len(drafts) + 1 positions (the verified token and its
        drafts), given each request's last position."""
        counts = num_drafts + 1
        starts = np.repeat(last_token - num_drafts, counts)
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        return starts + offsets
