"""Tokenizer, incremental detokenizer and stop strings: the one text pipeline
used by the gateway and by the offline LLM API (engine pods speak token ids)."""

from tessera.text.detokenizer import IncrementalDetokenizer
from tessera.text.tokenizer import encode_prompt, load_eos_token_ids, load_tokenizer

__all__ = ["IncrementalDetokenizer", "encode_prompt", "load_eos_token_ids", "load_tokenizer"]
