"""Rotary frequencies equal transformers' for every supported rope type."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine_pod.model.rotary import RotaryEmbedding, compute_inv_freq

HIDDEN, HEADS, HEAD_DIM = 256, 4, 64


def _hf(rope_parameters: dict, max_position_embeddings: int = 4096) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies and attention factor (v5: rope_parameters)."""
    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=dict(rope_parameters),
    )
    rope_type = cfg.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))


def _ours(rope_parameters: dict, max_position_embeddings: int = 4096) -> tuple[torch.Tensor, float]:
    params = dict(rope_parameters)
    theta = params.pop("rope_theta")
    scaling = None if params.get("rope_type", "default") == "default" else params
    return compute_inv_freq(HEAD_DIM, theta, scaling, max_position_embeddings, max_position_embeddings)


CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default-1e6": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
    },
    "llama3-8k": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-betas": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 512,
        "beta_fast": 16, "beta_slow": 2,
    },
    "yarn-mscale": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 0.707,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 2048,
        "attention_factor": 1.25,
    },
    "yarn-no-truncate": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "truncate": False,
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_matches_transformers(name):
    params = CASES[name]
    hf_inv, hf_factor = _hf(params)
    inv, factor = _ours(params)
    assert inv.shape == (HEAD_DIM // 2,)
    torch.testing.assert_close(inv.double(), hf_inv.double(), rtol=0, atol=1e-6)
    assert factor == pytest.approx(hf_factor, abs=1e-9)


def test_scalings_actually_change_the_frequencies():
    default, _ = _ours(CASES["default"])
    for name in ("linear", "yarn"):
        inv, _ = _ours(CASES[name])
        assert not torch.allclose(inv, default)
    linear, _ = _ours(CASES["linear"])
    torch.testing.assert_close(linear, default / 4.0)


def test_yarn_attention_factor():
    # Default: 0.1 * ln(factor) + 1.
    _, factor = _ours(CASES["yarn"])
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    # Explicit attention_factor wins.
    _, factor = _ours(CASES["yarn-attention-factor"])
    assert factor == 1.25
    # Non-yarn types have no attention factor.
    for name in ("default", "linear", "llama3"):
        assert _ours(CASES[name])[1] == 1.0


def test_yarn_without_original_max_uses_max_position_embeddings():
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    hf_inv, hf_factor = _hf(params, max_position_embeddings=2048)
    inv, factor = _ours(params, max_position_embeddings=2048)
    torch.testing.assert_close(inv.double(), hf_inv.double(), rtol=0, atol=1e-6)
    assert factor == pytest.approx(hf_factor)


def test_legacy_type_key_is_accepted():
    inv, _ = compute_inv_freq(HEAD_DIM, 10000.0, {"type": "linear", "factor": 2.0}, 2048, 2048)
    default, _ = compute_inv_freq(HEAD_DIM, 10000.0, None, 2048, 2048)
    torch.testing.assert_close(inv, default / 2.0)


@pytest.mark.parametrize("rope_type", ["longrope", "su", "mrope", "nonsense"])
def test_unknown_rope_type_raises_naming_rope_scaling(rope_type):
    with pytest.raises(ValueError, match="rope_scaling") as info:
        compute_inv_freq(HEAD_DIM, 10000.0, {"rope_type": rope_type, "factor": 2.0}, 2048, 2048)
    assert rope_type in str(info.value)


def test_dynamic_within_trained_context_is_default_and_beyond_raises():
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    inv, factor = compute_inv_freq(HEAD_DIM, 10000.0, scaling, 2048, 1024)
    default, _ = compute_inv_freq(HEAD_DIM, 10000.0, None, 2048, 1024)
    torch.testing.assert_close(inv, default)
    assert factor == 1.0
    with pytest.raises(ValueError, match="rope_scaling"):
        compute_inv_freq(HEAD_DIM, 10000.0, scaling, 2048, 4096)


def test_rotary_table_matches_transformers_cos_sin():
    params = CASES["yarn"]
    inv, factor = _ours(params)
    rope = RotaryEmbedding(HEAD_DIM, 300, inv, factor, torch.float64)
    cfg = LlamaConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096,
        rope_parameters=dict(params),
    )
    hf = LlamaRotaryEmbedding(cfg)
    positions = torch.arange(300).unsqueeze(0)
    cos, sin = hf(torch.zeros(1, dtype=torch.float64), positions)
    torch.testing.assert_close(rope.cos, cos[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(rope.sin, sin[0], rtol=0, atol=1e-12)
