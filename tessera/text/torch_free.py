"""Tokenizers without torch, for control-plane processes (the gateway).

transformers imports torch whenever it is installed (seconds of start-up and
hundreds of MiB), although tokenizing text and rendering chat templates never
touch it. A None entry in ``sys.modules`` is Python's documented way to make
a module unimportable: ``importlib.util.find_spec("torch")`` then answers
None, transformers' ``is_torch_available()`` is False, and it takes its
torch-free paths. ``AutoTokenizer`` still picks the same tokenizer class from
the same files, so token ids and chat-template text are unchanged
(tests/tessera/test_torch_free_tokenizer.py compares them).
"""

from __future__ import annotations

import logging
import sys

# What transformers logs at import when it sees no torch: expected here.
_NO_TORCH_ADVICE = "PyTorch was not found"


class _DropNoTorchAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_NO_TORCH_ADVICE)


def hide_torch_from_transformers() -> bool:
    """Make torch unimportable in this process, so transformers loads without
    it. Only a process's entry point calls this, before anything imports
    transformers; it does nothing (and returns False) in a process that has
    already imported torch or transformers, such as a test session that
    runs the engine and the gateway side by side."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    logging.getLogger("transformers").addFilter(_DropNoTorchAdvice())
    return True
