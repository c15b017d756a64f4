"""A real engine's blocks through the codec: a tensor's bytes go in as the
payload and come back as the same tensor, bit for bit, as a view of the
stored value (no copy on the way in from the store)."""

from __future__ import annotations

import pytest
import torch

from kv_store.codec import BlockLayout
from kv_store.tensor_codec import block_payload, payload_block, torch_dtype
from tests.kv_store.blocks import LAYOUT, block_hash, make_codec


def _block(layout: BlockLayout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape, generator=g, dtype=torch.float64).to(torch_dtype(layout))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_a_block_comes_back_bit_for_bit_through_the_signed_form(dtype):
    layout = BlockLayout(**{**LAYOUT.__dict__, "dtype": dtype})
    codec, block = make_codec(layout=layout), _block(layout, 3)
    signed = codec.sign(codec.encode(block_hash(0), block_payload(layout, block)))
    back = payload_block(layout, codec.decode(block_hash(0), signed))
    assert back.dtype == block.dtype == getattr(torch, dtype) and back.shape == block.shape
    assert torch.equal(back.view(torch.uint8), block.view(torch.uint8))


def test_the_decoded_block_is_a_view_of_the_stored_value():
    codec = make_codec()
    value = bytearray(codec.encode(block_hash(0), block_payload(LAYOUT, _block(LAYOUT, 1))))
    back = payload_block(LAYOUT, codec.decode(block_hash(0), value, verify_mac=False))
    value[-2:] = bytes(2)  # the last element's bytes, changed in place
    assert back.flatten()[-1].item() == 0.0


def test_a_non_contiguous_block_is_stored_in_layout_order():
    block = _block(LAYOUT, 2)
    strided = block.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, other strides
    assert not strided.is_contiguous()
    assert bytes(block_payload(LAYOUT, strided)) == bytes(block_payload(LAYOUT, block))


@pytest.mark.parametrize("block", [
    torch.zeros(LAYOUT.block_shape, dtype=torch.float32),  # another dtype
    torch.zeros((1, *LAYOUT.block_shape[1:]), dtype=torch.bfloat16),  # another shape
])
def test_a_block_that_does_not_fit_the_layout_is_refused(block):
    with pytest.raises(ValueError, match="does not fit"):
        block_payload(LAYOUT, block)
