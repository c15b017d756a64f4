"""A checkpoint tensor read lazily, only the rows or columns a rank holds.

Wraps a safetensors slice (``safe_open(...).get_slice(name)``): indexing it
reads just that range from the file, so a tensor-parallel rank never
materialises the whole tensor. A plain tensor works too (tests).
"""

from __future__ import annotations

import torch


class WeightSource:
    def __init__(self, name: str, source) -> None:
        self.name = name
        self._source = source  # a safetensors PySafeSlice or a torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        if isinstance(self._source, torch.Tensor):
            return tuple(self._source.shape)
        return tuple(self._source.get_shape())

    def full(self) -> torch.Tensor:
        return self._source[:]

    def rows(self, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) along dim 0 (1-D tensors: elements)."""
        self._check_range(0, start, count)
        return self._source[start : start + count]

    def columns(self, start: int, count: int) -> torch.Tensor:
        """Columns [start, start + count) of a 2-D tensor."""
        self._check_range(1, start, count)
        return self._source[:, start : start + count]

    def _check_range(self, dim: int, start: int, count: int) -> None:
        shape = self.shape
        if len(shape) <= dim or start + count > shape[dim]:
            raise ValueError(
                f"weight {self.name}: checkpoint shape {shape} has no range [{start}, {start + count}) on dim {dim}"
            )
