"""Prompt-lookup drafts: copy what followed the context's own last n-gram."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine_pod.spec_decode.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Up to k draft tokens for a context (prompt + output), or [] when no
        suffix of min_n..max_n tokens occurred earlier in it.

        The longest matching suffix wins; among its earlier occurrences the
        most recent one (nearest text repeats most faithfully).
        """
        tokens = np.asarray(token_ids, dtype=np.int64)
        end = self._match_end(tokens)
        if end < 0:
            return []
        # The occurrence ends at `end`, the suffix at len-1: the context looks
        # periodic with this shift, so the copy may run on into the drafts
        # it has just written (as an LZ77 back-reference does).
        shift = len(tokens) - 1 - end
        out = list(tokens[end + 1 :])[: self.k]
        while len(out) < self.k:
            out.append(out[len(out) - shift])
        return [int(t) for t in out]

    def _match_end(self, tokens: np.ndarray) -> int:
        """Index where the chosen earlier occurrence of the suffix ends, or -1.

        O(max_n * len) numpy: row j of ``same`` says whether the token j
        places before each candidate end equals the one j places before the
        context's end; the run of leading Trues is that candidate's match length.
        """
        num = len(tokens)
        if num < self.min_n + 1:
            return -1
        width = min(self.max_n, num - 1)
        ends = np.arange(num - 1)  # candidate ends; the last token cannot follow itself
        same = np.zeros((width, num - 1), dtype=bool)
        for j in range(width):
            valid = ends >= j
            same[j, valid] = tokens[ends[valid] - j] == tokens[num - 1 - j]
        match_len = np.cumprod(same, axis=0).sum(axis=0)
        best = int(match_len.max())
        if best < self.min_n:
            return -1
        return int(np.flatnonzero(match_len == best)[-1])
