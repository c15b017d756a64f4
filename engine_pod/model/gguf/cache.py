"""Serving a GGUF file directly: `--model FILE.gguf` converts it once into a cache folder.

The folder is keyed by the file's SHA-256, so a changed file is converted again and the same
file under another name is not; its last component is the file's stem, which is what a pod
reports as its model name. Conversions of one file by several processes at once (the pods of
`tessera up` start together) are serialised by a lock file: one converts, the others wait and
load its result.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

CACHE_ENV = "TESSERA_GGUF_CACHE"
"""Where converted GGUF files are kept (default ~/.cache/tessera/gguf)."""


GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a file that starts as a GGUF file does (read without the gguf package,
    which a pod serving a checkpoint folder never imports)."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tessera" / "gguf")


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def resolve_model_path(model: str | Path) -> Path:
    """The checkpoint folder for `model`: itself when it is a folder, the converted cache
    folder when it is a GGUF file."""
    path = Path(model)
    if not is_gguf_file(path):
        return path
    from engine_pod.model.gguf.convert import import_gguf  # torch and safetensors: only to convert

    root = cache_root() / file_digest(path)
    out = root / path.name.removesuffix(".gguf")
    if (out / "model.safetensors").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").is_file():
            import_gguf(path, out)
    return out
