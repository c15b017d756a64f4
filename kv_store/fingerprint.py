"""A model fingerprint: stored KV is only valid for the exact weights and dtype.

config.json alone would let two fine-tunes of one architecture share KV, so
the fingerprint also samples the weight files (their sizes and their first
and last MiB: distinct weights differ there almost surely) instead of
hashing gigabytes at start-up.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_SAMPLE = 1 << 20


def model_fingerprint(model_path: str | Path, dtype: str, extra: str = "") -> bytes:
    """16 bytes naming (config, weights, compute dtype, extra)."""
    path = Path(model_path)
    h = hashlib.sha256()
    config = json.loads((path / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True).encode())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            h.update(f.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                f.seek(size - _SAMPLE)
                h.update(f.read(_SAMPLE))
    h.update(dtype.encode())
    h.update(extra.encode())
    return h.digest()[:16]
