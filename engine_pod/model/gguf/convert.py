"""`import_gguf`: a GGUF file -> a Hugging Face checkpoint folder, all or nothing.

The folder is written beside its destination under a temporary name and renamed into place
only once every file is complete, so a failure (a bad tensor, a full disk, a kill) leaves no
half-written checkpoint that a later load would take for a whole one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import gguf
import torch
from safetensors.torch import save_file

from engine_pod.model.gguf.architectures import architecture_of, hf_config
from engine_pod.model.gguf.gguf_file import GGUFFile
from engine_pod.model.gguf.tensors import hf_tensors, is_tied
from engine_pod.model.gguf.tokenizer import end_token_ids, special_token_ids, write_tokenizer
from engine_pod.model.hf_config import dtype_name

_HALF_TYPES = {gguf.GGMLQuantizationType.F16: "float16", gguf.GGMLQuantizationType.BF16: "bfloat16"}


def auto_dtype(file: GGUFFile) -> str:
    """The dtype that holds the file's values exactly: its half type where every tensor is
    stored in that one, else float32 (what every quantized type dequantizes to; llama.cpp keeps
    norms in F32 even in an F16 file, and those do not fit a half type)."""
    kinds = {t.tensor_type for t in file.reader.tensors}
    if len(kinds) == 1 and next(iter(kinds)) in _HALF_TYPES:
        return _HALF_TYPES[next(iter(kinds))]
    return "float32"


def _write_checkpoint(file: GGUFFile, out: Path, dtype: str) -> None:
    arch = architecture_of(file)
    ids = special_token_ids(file)
    max_len = int(file.require(f"{file.architecture}.context_length"))
    vocab_size = write_tokenizer(file, out, max_len)
    cfg = hf_config(file, vocab_size, is_tied(file), dtype,
                    {"bos": ids["bos"], "eos": ids["eos"], "pad": ids["pad"]})
    tensors = dict(hf_tensors(file, arch, cfg, getattr(torch, dtype)))
    rows = tensors["model.embed_tokens.weight"].shape[0]
    if rows != vocab_size:
        raise ValueError(f"{file.path}: the embedding has {rows} rows, the tokenizer {vocab_size} tokens")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": ids["bos"], "eos_token_id": end_token_ids(file), "pad_token_id": ids["pad"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def _make_readable(folder: Path) -> None:
    # mkdtemp makes the folder private; the checkpoint is shared as any other is (the umask's modes).
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def import_gguf(path: str | Path, out: str | Path, dtype: str = "auto") -> Path:
    """Write the checkpoint of the GGUF file `path` into the folder `out` (which must not exist,
    or be empty), its weights in `dtype` ("auto": see auto_dtype)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty folder")
    file = GGUFFile(path)
    dtype = auto_dtype(file) if dtype == "auto" else dtype_name(dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_checkpoint(file, staging, dtype)
        _make_readable(staging)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
