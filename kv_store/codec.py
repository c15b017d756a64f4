"""The wire format of one KV block: every layer's K and V of one TP rank.

    header (fixed size, little endian) | payload (raw tensor bytes)

The header names everything that must match for the bytes to be usable by a
reader: format version, model fingerprint, TP rank and size, block size,
layer count, dtype, shape and the block hash; a CRC32 covers header and
payload. ``decode`` checks all of it and raises ``CorruptBlockError`` on any
mismatch, which callers treat as a miss.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"TKV1"
FORMAT_VERSION = 1
FINGERPRINT_BYTES = 16

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
# Same-width integer views: numpy has no bfloat16, so bytes travel as ints.
_RAW_VIEWS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
              torch.float64: torch.int64}

# magic, version, fingerprint, tp rank, tp size, block size, layers, dtype,
# shape (2, block_size, kv heads, head dim), block hash, payload length, crc32
_HEADER = struct.Struct("<4sH16sHHIIB4I32sQI")
HEADER_SIZE = _HEADER.size


class CorruptBlockError(ValueError):
    """The bytes are not a valid block for this reader."""


@dataclass(frozen=True)
class BlockLayout:
    """What a reader expects: fixed per engine (model, dtype, TP rank, cache shape)."""

    fingerprint: bytes  # FINGERPRINT_BYTES
    tp_rank: int
    tp_size: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[layers, K/V, block_size, kv heads, head dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * torch.empty((), dtype=self.dtype).element_size()


class BlockCodec:
    def __init__(self, layout: BlockLayout) -> None:
        if len(layout.fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
        if layout.dtype not in _DTYPE_CODES:
            raise ValueError(f"dtype {layout.dtype} cannot be stored")
        self.layout = layout

    def _header(self, block_hash: bytes, payload: memoryview | bytes, crc: int) -> bytes:
        lay = self.layout
        return _HEADER.pack(
            MAGIC, FORMAT_VERSION, lay.fingerprint, lay.tp_rank, lay.tp_size, lay.block_size, lay.num_layers,
            _DTYPE_CODES[lay.dtype], 2, lay.block_size, lay.num_kv_heads, lay.head_dim, block_hash,
            len(payload), crc,
        )

    def encode(self, block_hash: bytes, block: torch.Tensor) -> bytes:
        """``block``: a contiguous CPU tensor of ``layout.block_shape``."""
        if tuple(block.shape) != self.layout.block_shape or block.dtype != self.layout.dtype:
            raise ValueError(f"block of shape {tuple(block.shape)} {block.dtype} does not fit {self.layout}")
        payload = memoryview(block.contiguous().view(_RAW_VIEWS[block.dtype]).numpy()).cast("B")
        crc = zlib.crc32(payload, zlib.crc32(block_hash))
        return self._header(block_hash, payload, crc) + payload

    def decode(self, block_hash: bytes, data: bytes | memoryview) -> torch.Tensor:
        """The block tensor (a read-only view of ``data``), or CorruptBlockError."""
        if len(data) < HEADER_SIZE:
            raise CorruptBlockError(f"value of {len(data)} bytes is shorter than the header")
        fields = _HEADER.unpack_from(data)
        magic, version, fingerprint, rank, size, block_size, layers, dtype_code = fields[:8]
        shape, stored_hash, length, crc = tuple(fields[8:12]), fields[12], fields[13], fields[14]
        lay = self.layout
        expected = (MAGIC, FORMAT_VERSION, lay.fingerprint, lay.tp_rank, lay.tp_size, lay.block_size,
                    lay.num_layers, _DTYPE_CODES[lay.dtype], (2, lay.block_size, lay.num_kv_heads, lay.head_dim),
                    block_hash, lay.payload_bytes)
        found = (magic, version, fingerprint, rank, size, block_size, layers, dtype_code, shape, stored_hash, length)
        names = ("magic", "version", "fingerprint", "tp_rank", "tp_size", "block_size", "num_layers", "dtype",
                 "shape", "block_hash", "payload length")
        for name, want, got in zip(names, expected, found):
            if want != got:
                raise CorruptBlockError(f"header {name} mismatch")
        payload = memoryview(data)[HEADER_SIZE:]
        if len(payload) != length:
            raise CorruptBlockError(f"payload is {len(payload)} bytes, header says {length}")
        if zlib.crc32(payload, zlib.crc32(block_hash)) != crc:
            raise CorruptBlockError("checksum mismatch")
        with warnings.catch_warnings():
            # A view of the stored bytes that callers only read (they copy it
            # into the KV cache): torch's warning about read-only buffers is noise.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=_RAW_VIEWS[lay.dtype])
        return raw.view(lay.dtype).view(lay.block_shape)
