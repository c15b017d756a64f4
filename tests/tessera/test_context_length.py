"""One context length for the gateway and the engine (tessera/context_length.py):
on checkpoints with a sliding window, the gateway's limit is the engine's."""

from __future__ import annotations

import json
import shutil

import pytest

from engine_pod.config import create_engine_config
from gateway.config import GatewayConfigError, ModelConfig
from gateway.model import ServedModel
from tessera.context_length import context_limit, resolve_max_model_len


def _variant(source, out, **config_changes):
    """A copy of a checkpoint's config and tokenizer (no weights: neither side reads them here)."""
    out.mkdir()
    for f in source.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((source / "config.json").read_text())
    config.update(config_changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _gateway_len(path, max_model_len=None) -> int:
    return ServedModel.load(ModelConfig("m", str(path), max_model_len)).max_model_len


def _engine_len(path, max_model_len=None) -> int:
    return create_engine_config(path, max_model_len=max_model_len, device="cpu").model.max_model_len


@pytest.mark.parametrize("preset,changes,expected", [
    ("tiny-mistral", {"sliding_window": 128}, 128),
    ("tiny-mistral", {"sliding_window": None}, 2048),
    ("tiny-mistral", {"sliding_window": 4096}, 2048),  # a window wider than the positions caps nothing
    ("tiny-qwen2", {"sliding_window": 64, "use_sliding_window": True}, 64),
    # Qwen2 carries a sliding_window it uses only with use_sliding_window.
    ("tiny-qwen2", {"sliding_window": 64, "use_sliding_window": False}, 2048),
    ("tiny", {"max_position_embeddings": 300}, 300),
])
def test_gateway_and_engine_agree(request, tmp_path, preset, changes, expected):
    source = request.getfixturevalue({"tiny-mistral": "tiny_mistral", "tiny-qwen2": "tiny_qwen2",
                                      "tiny": "tiny_llama"}[preset])
    path = _variant(source, tmp_path / "ckpt", **changes)
    assert _gateway_len(path) == _engine_len(path) == expected
    assert context_limit(json.loads((path / "config.json").read_text())) == expected


def test_a_max_model_len_over_the_window_is_refused_by_both(tiny_mistral, tmp_path):
    path = _variant(tiny_mistral, tmp_path / "ckpt", sliding_window=128)
    assert _gateway_len(path, 100) == _engine_len(path, 100) == 100
    with pytest.raises(ValueError, match=r"max_model_len \(129\) exceeds what the model supports \(128"):
        _engine_len(path, 129)
    with pytest.raises(GatewayConfigError, match=r"model\.max_model_len \(129\) exceeds"):
        _gateway_len(path, 129)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_max_model_len_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="max_model_len must be a positive integer"):
        resolve_max_model_len(bad, {"max_position_embeddings": 64})


def test_default_positions_when_config_names_none():
    assert resolve_max_model_len(None, {}) == 2048
