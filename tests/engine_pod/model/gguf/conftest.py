"""GGUF files made from the tiny checkpoints (tessera_tools/fixtures/make_gguf.py), once a session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import checkpoint
from tessera_tools.fixtures.make_gguf import Q, make_gguf


@pytest.fixture(scope="session")
def tiny_gguf_base() -> Path:
    """tiny-gguf: a Llama shape whose rows are all multiples of 256, so every type quantizes it."""
    return checkpoint("tiny-gguf")


@pytest.fixture(scope="session")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="session")
def tiny_gguf_q8(tiny_gguf_base, gguf_dir) -> Path:
    """tiny-gguf as a Q8_0 file."""
    return make_gguf(tiny_gguf_base, gguf_dir / "tiny-gguf.Q8_0.gguf", Q.Q8_0)
