"""transformers with torch hidden (tessera/text/torch_free.py, what the gateway
does) gives the tokenizer it gives with torch: the same class, the same ids,
the same chat-template text."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.text import encode_prompt, load_tokenizer
from tessera.text.torch_free import hide_torch_from_transformers

ROOT = Path(__file__).resolve().parent.parent.parent
TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "ünïcödé 日本語 🙂", "<|im_start|>user", ""]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Because."}, {"role": "user", "content": "ok"}],
]

_SUMMARY = """
def summary(path, texts, chats):
    from tessera.text import encode_prompt, load_tokenizer
    tok = load_tokenizer(path)
    return {
        "class": type(tok).__name__,
        "ids": [encode_prompt(tok, t) for t in texts],
        "encode": [tok.encode(t) for t in texts],
        "chat": [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats],
        "chat_ids": [encode_prompt(tok, tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)
                     for c in chats],
        "decode": [tok.decode(tok.encode(t)) for t in texts],
    }
"""


def _in_process(path) -> dict:
    scope: dict = {}
    exec(_SUMMARY, scope)
    return json.loads(json.dumps(scope["summary"](str(path), TEXTS, CHATS)))


def _without_torch(path) -> dict:
    code = (
        "import json, sys\n"
        "from tessera.text.torch_free import hide_torch_from_transformers\n"
        "assert hide_torch_from_transformers()\n"
        f"{_SUMMARY}\n"
        f"out = summary({str(path)!r}, {TEXTS!r}, {CHATS!r})\n"
        "assert sys.modules.get('torch') is None\n"
        "print(json.dumps(out))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "PyTorch was not found" not in proc.stderr  # expected, so not logged
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("preset,tokenizer_class", [
    ("tiny_llama", None), ("tiny_qwen2", None), ("tiny_mistral", None),
    # Hub checkpoints name model-specific classes, which AutoTokenizer resolves its own way.
    ("tiny_qwen2", "Qwen2Tokenizer"), ("tiny_llama", "LlamaTokenizerFast"), ("tiny_mistral", "LlamaTokenizer"),
])
def test_same_tokenizer_without_torch(request, tmp_path, preset, tokenizer_class):
    path = request.getfixturevalue(preset)
    if tokenizer_class is not None:
        path = shutil.copytree(path, tmp_path / "ckpt", ignore=shutil.ignore_patterns("*.safetensors"))
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
    assert _without_torch(path) == _in_process(path)


def test_does_nothing_once_torch_or_transformers_is_loaded(tiny_llama):
    import torch  # noqa: F401  (this test session has it)

    assert hide_torch_from_transformers() is False
    assert sys.modules["torch"] is not None
    assert encode_prompt(load_tokenizer(tiny_llama), "hi")
