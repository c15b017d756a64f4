"""A GGUF file opened with the `gguf` package, its metadata read as plain values.

Every way a file can fail to open (wrong magic, an unknown version, a truncated header or
tensor table, a tensor type the package does not know) becomes one ValueError naming the file,
so the command line exits 2 with it instead of a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

class GGUFFile:
    """The reader of one GGUF file and typed access to its metadata."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except FileNotFoundError:
            raise ValueError(f"{self.path}: no such file") from None
        except Exception as e:  # the reader raises ValueError, IndexError, struct errors for a bad file
            raise ValueError(f"{self.path}: not a readable GGUF file ({_reason(e)})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._check_tensor_data()

    def _check_tensor_data(self) -> None:
        # The reader maps the file; a tensor whose bytes run past its end was cut short.
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ValueError(f"{self.path}: truncated: tensor {t.name} needs bytes up to {end}, "
                                 f"the file has {size}")

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """The value of a metadata key (a str, number, bool or list), or `default`."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value.tolist() if isinstance(value, np.ndarray) else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.path}: lacks the metadata key {key!r}")
        return value

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))


def _reason(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 200 else text[:200] + "..."
