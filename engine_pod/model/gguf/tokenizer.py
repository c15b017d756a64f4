"""A GGUF file's tokenizer as tokenizer.json and tokenizer_config.json.

A byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`) is rebuilt with the `tokenizers`
library from the file's tokens, merges and token types, with the pre-tokenizer that
`tokenizer.ggml.pre` names (llama.cpp picks its split rules by that name; a name outside the
table below is refused rather than guessed, since a wrong split changes every number's
tokens). A SentencePiece vocabulary (`llama`) is converted by transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers import AddedToken

from engine_pod.model.gguf.gguf_file import GGUFFile

_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType

# GPT-2's split, which every byte-level pre-tokenizer below starts from.
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
# Llama 3's and Qwen2's splits (digits in runs of at most three, or one by one).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _regex_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _digits_then_bytes() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's StarCoder family (SmolLM's among them): each digit alone, then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _BYTE_LEVEL])


# `tokenizer.ggml.pre` -> the pre-tokenizer llama.cpp applies for it.
PRE_TOKENIZERS = {
    "default": lambda: _BYTE_LEVEL,
    "gpt2": lambda: _BYTE_LEVEL,
    "smollm": _digits_then_bytes,
    "starcoder": _digits_then_bytes,
    "refact": _digits_then_bytes,
    "llama-bpe": lambda: _regex_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _regex_then_bytes(QWEN2_SPLIT),
}


def _byte_level_bpe(file: GGUFFile, tokens: list[str]) -> Tokenizer:
    pre = file.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{file.path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer this import knows; "
                         f"known: {sorted(PRE_TOKENIZERS)}")
    merges = file.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError(f"{file.path}: a gpt2 tokenizer without tokenizer.ggml.merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    types = file.get("tokenizer.ggml.token_type") or []
    added = [AddedToken(tokens[i], special=(kind == _CONTROL), normalized=False)
             for i, kind in enumerate(types) if kind in (_CONTROL, _USER_DEFINED)]
    tok.add_tokens(added)
    return tok


def _with_bos(tok: Tokenizer, bos: str, bos_id: int) -> None:
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, bos_id)])


def _spm_via_transformers(file: GGUFFile) -> Tokenizer:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(file.path.parent), gguf_file=file.path.name)
    return hf.backend_tokenizer


def special_token_ids(file: GGUFFile) -> dict[str, int | None]:
    """bos, eos, pad and unk ids as the file names them (None where it does not)."""
    return {name: file.get(f"tokenizer.ggml.{key}_token_id")
            for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}


def end_token_ids(file: GGUFFile) -> list[int]:
    """Every id that ends a turn: EOS, and the end-of-turn and end-of-message tokens where named."""
    ids = [file.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    return sorted({i for i in ids if i is not None})


def write_tokenizer(file: GGUFFile, out: Path, max_length: int) -> int:
    """Write tokenizer.json and tokenizer_config.json into `out`; returns the vocabulary size."""
    kind = file.get("tokenizer.ggml.model")
    tokens = file.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise ValueError(f"{file.path}: carries no tokenizer (tokenizer.ggml.model and tokenizer.ggml.tokens); "
                         f"give one with the checkpoint instead")
    if kind == "gpt2":
        tok = _byte_level_bpe(file, tokens)
    elif kind == "llama":
        tok = _spm_via_transformers(file)
    else:
        raise ValueError(f"{file.path}: tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
    ids = special_token_ids(file)
    named = {name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)}
    add_bos = bool(file.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and "bos" in named and kind == "gpt2":
        _with_bos(tok, named["bos"], ids["bos"])
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        **{f"{name}_token": token for name, token in named.items()},
    }
    template = file.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return len(tokens)
