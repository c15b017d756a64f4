"""Loading a checkpoint's tokenizer and its end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    # Imported here, not with the module: a control-plane process decides
    # first whether transformers may see torch (tessera/text/torch_free.py).
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for a broken folder
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path}: {e}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer: {path} has no fast (tokenizer.json) tokenizer")
    return tokenizer


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a prompt: what `tokenizer.encode(text)` gives, straight
    from the Rust tokenizer (the Python wrapper costs more than the
    encoding itself for short prompts, and the gateway pays it per request)."""
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def load_eos_token_ids(path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS and the
    generation config's (falling back to config.json's) eos_token_id."""
    path = Path(path)
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            found = _as_list(json.loads(file.read_text()).get("eos_token_id"))
            if found:
                ids.update(found)
                break
    return ids
