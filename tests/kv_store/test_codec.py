"""The block codec: round trips signed and unsigned, and every forgery refused with its reason."""

from __future__ import annotations

import pytest

from kv_store.codec import HEADER_SIZE, MAC_BYTES, BlockCodec, BlockLayout, CorruptBlockError
from tests.kv_store.blocks import FORGERIES, KEY, LAYOUT, block_hash, genuine_value, make_codec, make_payload


def test_codec_round_trip_signed_and_unsigned():
    codec = make_codec()
    payload = make_payload(1)
    value = codec.encode(block_hash(0), payload)
    assert len(value) == HEADER_SIZE + LAYOUT.payload_bytes
    # The host tier's form: MAC zero, decoded without verification.
    assert value[HEADER_SIZE - MAC_BYTES: HEADER_SIZE] == bytes(MAC_BYTES)
    assert codec.decode(block_hash(0), value, verify_mac=False) == payload
    # The shared tiers' form: the same bytes with the MAC set.
    signed = codec.sign(value)
    assert signed[:HEADER_SIZE - MAC_BYTES] == value[:HEADER_SIZE - MAC_BYTES]
    assert signed[HEADER_SIZE:] == value[HEADER_SIZE:]
    assert codec.decode(block_hash(0), signed) == payload
    with pytest.raises(CorruptBlockError) as info:
        codec.decode(block_hash(0), value)  # an unsigned value never passes for a shared one
    assert info.value.reason == "mac"


def test_a_payload_of_another_size_is_refused():
    for size in (LAYOUT.payload_bytes - 1, LAYOUT.payload_bytes + 2):
        with pytest.raises(ValueError, match="does not fit"):
            make_codec().encode(block_hash(0), bytes(size))


def test_a_codec_without_a_key_cannot_sign_or_verify():
    codec = make_codec(key=None)
    value = codec.encode(block_hash(0), make_payload(1))
    assert codec.decode(block_hash(0), value, verify_mac=False) == make_payload(1)
    for call in (lambda: codec.sign(value), lambda: codec.decode(block_hash(0), value)):
        with pytest.raises(ValueError, match="kv_mac_key"):
            call()
    with pytest.raises(ValueError, match="kv_mac_key"):
        BlockCodec(LAYOUT, b"short")
    assert "signs=False" in repr(codec) and KEY.hex() not in repr(make_codec())


@pytest.mark.parametrize("field,change", [
    ("fingerprint", dict(fingerprint=b"g" * 16)),
    ("tp_rank", dict(tp_rank=1, tp_size=2)),
    ("num_layers", dict(num_layers=3)),
    ("block_size", dict(block_size=8)),
    ("dtype", dict(dtype="float16")),
])
def test_codec_rejects_a_different_layout(field, change):
    value = make_codec().sign(make_codec().encode(block_hash(0), make_payload(1)))
    other = BlockLayout(**{**LAYOUT.__dict__, **change})
    with pytest.raises(CorruptBlockError) as info:
        make_codec(layout=other).decode(block_hash(0), value)
    assert info.value.reason in ("misaddressed", "truncated")


def test_a_dtype_the_format_has_no_code_for_is_refused():
    with pytest.raises(ValueError, match="int8 cannot be stored"):
        BlockCodec(BlockLayout(**{**LAYOUT.__dict__, "dtype": "int8"}))


@pytest.mark.parametrize("name", list(FORGERIES))
def test_codec_refuses_forged_replayed_truncated_and_misaddressed_values(name):
    make, reason = FORGERIES[name]
    with pytest.raises(CorruptBlockError) as info:
        make_codec().decode(block_hash(0), make(genuine_value(0)))
    assert info.value.reason == reason
