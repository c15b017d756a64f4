"""The wire format of one KV block: every layer's K and V of one TP rank's
KV heads (engines store whole blocks, rank 0 of 1, whatever their TP degree:
engine_pod/engine/kv_store_factory.py).

    fields (fixed size, little endian) | MAC (32 bytes) | payload (the block's raw bytes)

The fields name everything that must match for the bytes to be usable by a
reader: format version, model fingerprint, TP rank and size, block size,
layer count, dtype, shape and the block hash. The MAC is HMAC-SHA256, keyed
with the deployment's KV key (``InternalSecret.kv_mac_key``), over the fields
and the payload: a value written by anyone without the key (a forger, another
deployment) fails it, and so does any damaged byte, so no separate checksum
is kept. HMAC-SHA256 rather than keyed BLAKE2b: on a 2 MiB block here it takes
0.96 ms against BLAKE2b's 1.39 ms (OpenSSL's SHA-256 uses the CPU's SHA
instructions).

Only values bound for a shared tier are signed (``sign``): ``encode`` leaves
the MAC zero, because the host tier is this process's own memory and holds
only values this process encoded or verified, and never hands them on.
``decode`` raises ``CorruptBlockError`` (with a ``reason``) on any mismatch,
which callers treat as a miss.

The codec works on bytes and imports no torch, so the store moves blocks for
a simulated engine too; ``tensor_codec.py`` turns a real engine's block
tensors into payloads and back.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from dataclasses import dataclass
from typing import Any

from kv_store.mac_key import check_mac_key

# Version 1 had a CRC32 and no MAC; its values are refused (reason "format").
MAGIC = b"TKV2"
FORMAT_VERSION = 2
FINGERPRINT_BYTES = 16
MAC_BYTES = 32

# Why a value was refused (a label of tessera_kv_store_rejected_values_total).
REJECT_TRUNCATED = "truncated"  # shorter than its header, or its payload length is wrong
REJECT_FORMAT = "format"  # not this format or version (e.g. written before the MAC)
REJECT_MAC = "mac"  # the MAC does not match: forged, another deployment's key, or damaged
REJECT_MISADDRESSED = "misaddressed"  # authentic, but another block's (or layout's): copied under a wrong key
REJECT_REASONS = (REJECT_TRUNCATED, REJECT_FORMAT, REJECT_MAC, REJECT_MISADDRESSED)

# The dtypes a block may be stored in, by name: (code in the header, bytes per element).
STORED_DTYPES = {"float32": (1, 4), "float16": (2, 2), "bfloat16": (3, 2), "float64": (4, 8)}

# magic, version, fingerprint, tp rank, tp size, block size, layers, dtype,
# shape (2, block_size, kv heads, head dim), block hash, payload length
_FIELDS = struct.Struct("<4sH16sHHIIB4I32sQ")
HEADER_SIZE = _FIELDS.size + MAC_BYTES
_NO_MAC = bytes(MAC_BYTES)

# What a payload may be handed in as: the raw bytes, or a view of them.
Payload = bytes | bytearray | memoryview


class CorruptBlockError(ValueError):
    """The bytes are not a valid block for this reader; ``reason`` is one of REJECT_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class BlockLayout:
    """What a reader expects: fixed per engine (model, dtype, TP rank, cache shape)."""

    fingerprint: bytes
    """FINGERPRINT_BYTES naming the model, its dtype and the format (fingerprint.py)."""
    tp_rank: int
    """The tensor-parallel rank whose share of the heads the block holds."""
    tp_size: int
    """The tensor-parallel degree the block was split for."""
    num_layers: int
    """Decoder layers: the block holds K and V of each."""
    block_size: int
    """Tokens per block."""
    num_kv_heads: int
    """KV heads of this rank."""
    head_dim: int
    """Elements per head."""
    dtype: str
    """The element type, by name: a key of STORED_DTYPES."""

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[layers, K/V, block_size, kv heads, head dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        return math.prod(self.block_shape) * STORED_DTYPES[self.dtype][1]


class BlockCodec:
    def __init__(self, layout: BlockLayout, mac_key: bytes | None = None) -> None:
        """``mac_key``: the deployment's KV key; None for a codec that only
        serves the host tier (it can encode and decode, not sign or verify)."""
        if len(layout.fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
        if layout.dtype not in STORED_DTYPES:
            raise ValueError(f"dtype {layout.dtype} cannot be stored")
        check_mac_key(mac_key)
        self.layout = layout
        self._mac_key = mac_key

    def __repr__(self) -> str:  # never the key
        return f"BlockCodec({self.layout}, signs={self.can_sign})"

    @property
    def can_sign(self) -> bool:
        return self._mac_key is not None

    def _fields(self, block_hash: bytes) -> bytes:
        lay = self.layout
        return _FIELDS.pack(
            MAGIC, FORMAT_VERSION, lay.fingerprint, lay.tp_rank, lay.tp_size, lay.block_size, lay.num_layers,
            STORED_DTYPES[lay.dtype][0], 2, lay.block_size, lay.num_kv_heads, lay.head_dim, block_hash,
            lay.payload_bytes,
        )

    def _mac(self, fields: memoryview | bytes, payload: memoryview | bytes) -> bytes:
        if self._mac_key is None:
            raise ValueError("this KV codec has no MAC key (kv_mac_key): it cannot sign or verify shared values")
        h = hmac.new(self._mac_key, fields, hashlib.sha256)
        h.update(payload)  # OpenSSL releases the GIL while it hashes a large buffer
        return h.digest()

    def encode(self, block_hash: bytes, payload: Payload) -> bytes:
        """The host tier's form (MAC left zero) of one block's raw bytes
        (``layout.payload_bytes`` of them, in ``layout.block_shape`` order)."""
        if len(payload) != self.layout.payload_bytes:
            raise ValueError(f"a payload of {len(payload)} bytes does not fit {self.layout} "
                             f"({self.layout.payload_bytes} bytes)")
        return b"".join((self._fields(block_hash), _NO_MAC, payload))

    def sign(self, value: bytes) -> bytes:
        """The shared tiers' form of an encoded value: a copy with its MAC set."""
        view = memoryview(value)
        fields, payload = view[: _FIELDS.size], view[HEADER_SIZE:]
        return b"".join((fields, self._mac(fields, payload), payload))

    def decode(self, block_hash: bytes, data: bytes | memoryview, verify_mac: bool = True) -> memoryview:
        """The block's payload (a read-only view of ``data``), or CorruptBlockError.
        ``verify_mac=False`` only for the host tier's own values."""
        view = memoryview(data)
        if len(view) < HEADER_SIZE:
            raise CorruptBlockError(REJECT_TRUNCATED, f"value of {len(view)} bytes is shorter than the header")
        fields = _FIELDS.unpack_from(view)
        if fields[0] != MAGIC or fields[1] != FORMAT_VERSION:
            raise CorruptBlockError(REJECT_FORMAT, "not a version-2 KV block (magic or version)")
        payload = view[HEADER_SIZE:]
        if len(payload) != fields[13]:
            raise CorruptBlockError(REJECT_TRUNCATED, f"payload is {len(payload)} bytes, header says {fields[13]}")
        # Nothing else of the header is believed before the MAC checks out.
        if verify_mac and not hmac.compare_digest(self._mac(view[: _FIELDS.size], payload),
                                                  view[_FIELDS.size: HEADER_SIZE]):
            raise CorruptBlockError(REJECT_MAC, "MAC mismatch (forged, another deployment's key, or damaged)")
        self._check_fields(block_hash, fields)
        return payload

    def _check_fields(self, block_hash: bytes, fields: tuple[Any, ...]) -> None:
        fingerprint, rank, size, block_size, layers, dtype_code = fields[2:8]
        shape, stored_hash, length = tuple(fields[8:12]), fields[12], fields[13]
        lay = self.layout
        expected = (lay.fingerprint, lay.tp_rank, lay.tp_size, lay.block_size, lay.num_layers,
                    STORED_DTYPES[lay.dtype][0], (2, lay.block_size, lay.num_kv_heads, lay.head_dim),
                    block_hash, lay.payload_bytes)
        found = (fingerprint, rank, size, block_size, layers, dtype_code, shape, stored_hash, length)
        names = ("fingerprint", "tp_rank", "tp_size", "block_size", "num_layers", "dtype", "shape", "block_hash",
                 "payload length")
        for name, want, got in zip(names, expected, found):
            if want != got:
                raise CorruptBlockError(REJECT_MISADDRESSED, f"header {name} mismatch")
