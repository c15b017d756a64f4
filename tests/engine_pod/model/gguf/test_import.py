"""`import_gguf` against transformers' own GGUF loader, the oracle: every tensor type the issue
names, both families, the tokenizer, and the folder's files."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_pod.model.gguf.convert import import_gguf
from tessera_tools.fixtures.make_gguf import Q, make_gguf

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
IDS = torch.tensor([[5, 100, 2000, 37, 8000, 12, 99, 400, 3, 1500]])


def _logits(folder, gguf_file=None) -> torch.Tensor:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_logits_equal_transformers_dequantization(qtype, tiny_gguf_base, tmp_path):
    file = make_gguf(tiny_gguf_base, tmp_path / f"m.{qtype.name}.gguf", qtype)
    out = import_gguf(file, tmp_path / "ckpt")
    ours, theirs = _logits(out), _logits(tmp_path, file.name)
    diff = (ours - theirs).abs().max().item()
    print(f"{qtype.name}: max |logit difference| vs transformers = {diff:.3g}")
    assert diff <= 1e-5, f"{qtype.name}: logits differ from transformers' by {diff}"
    if qtype == Q.F32:  # lossless: the original checkpoint's logits come back
        assert (ours - _logits(tiny_gguf_base)).abs().max().item() <= 1e-5


def test_quantized_file_is_float32_and_half_file_keeps_its_type(tiny_gguf_base, tiny_gguf_q8, tmp_path):
    q8 = import_gguf(tiny_gguf_q8, tmp_path / "q8")
    assert json.loads((q8 / "config.json").read_text())["torch_dtype"] == "float32"
    asked = import_gguf(tiny_gguf_q8, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((asked / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(asked / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_qwen2_file_with_biases_and_its_tokenizer(tiny_qwen2, tmp_path):
    file = make_gguf(tiny_qwen2, tmp_path / "qwen2.gguf", Q.F32)
    out = import_gguf(file, tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (_logits(out) - _logits(tiny_qwen2)).abs().max().item() <= 1e-5
    ours, source = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(tiny_qwen2))
    for text in ("Hello, world! 12345 numbers", "  two  spaces\nnew line\ttab", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == source.encode(text), text


def test_folder_has_tokenizer_chat_template_and_generation_config(tiny_gguf_base, tiny_gguf_q8, tmp_path):
    out = import_gguf(tiny_gguf_q8, tmp_path / "ckpt")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    source_cfg = json.loads((tiny_gguf_base / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == source_cfg["chat_template"]
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == (source_cfg["bos_token"], source_cfg["eos_token"])
    generation = json.loads((out / "generation_config.json").read_text())
    source_gen = json.loads((tiny_gguf_base / "generation_config.json").read_text())
    assert generation["eos_token_id"] == source_gen["eos_token_id"][:1]  # the file names one EOS
    ours, source = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(tiny_gguf_base))
    text = "The lighthouse keeper wrote 19 entries, then slept. <|im_end|>"
    assert ours.encode(text) == source.encode(text)
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        source.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_out_must_be_new_or_empty(tiny_gguf_q8, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        import_gguf(tiny_gguf_q8, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    assert (import_gguf(tiny_gguf_q8, tmp_path / "empty") / "model.safetensors").is_file()
