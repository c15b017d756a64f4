"""A real engine's side of the block codec: one block's tensor as the
codec's payload bytes and back, without copying on the way in from the store.

The only module of the store that imports torch: the codec and the tiers
move bytes (codec.py), so a simulated engine, which has no tensors, uses
them as they are.
"""

from __future__ import annotations

import warnings

import torch

from kv_store.codec import BlockLayout, Payload

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}
# Same-width integer views: numpy has no bfloat16, so bytes travel as ints.
_RAW_VIEWS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
              torch.float64: torch.int64}


def torch_dtype(layout: BlockLayout) -> torch.dtype:
    """The torch dtype of the layout's named dtype."""
    return _TORCH_DTYPES[layout.dtype]


def block_payload(layout: BlockLayout, block: torch.Tensor) -> memoryview:
    """The raw bytes of ``block``, a CPU tensor of ``layout.block_shape`` in
    the layout's dtype (a view when it is contiguous)."""
    dtype = torch_dtype(layout)
    if tuple(block.shape) != layout.block_shape or block.dtype != dtype:
        raise ValueError(f"block of shape {tuple(block.shape)} {block.dtype} does not fit {layout}")
    return block.contiguous().view(_RAW_VIEWS[dtype]).numpy().data.cast("B")


def payload_block(layout: BlockLayout, payload: Payload) -> torch.Tensor:
    """The block tensor over ``payload`` (a decoded value: a read-only view, not a copy)."""
    dtype = torch_dtype(layout)
    with warnings.catch_warnings():
        # A view of the stored bytes that callers only read (they copy it
        # into the KV cache): torch's warning about read-only buffers is noise.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(payload, dtype=_RAW_VIEWS[dtype])
    return raw.view(dtype).view(layout.block_shape)
