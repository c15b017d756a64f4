"""The Llama family (Llama, Mistral, Qwen2) over a flattened token batch.

All scheduled tokens of a step form one sequence of T tokens with no
padding; attention finds each token's context through the paged KV cache.
Module names follow the Hugging Face checkpoints, with q/k/v and gate/up
merged into one projection each (see ``STACKED_PARAMS``).

The residual stream is passed between layers beside the hidden state (as
vLLM does), so each residual add happens inside the norm that follows it:
on a CPU engine (``cpu_kernels``: attention backend "cpu", whose C++ kernels
built, and a float32/bf16/fp16 model) that is one kernel, as are rotary and SiLU-times-up.

Under tensor parallelism each rank builds the same modules with its share of
the heads, the intermediate size and the vocabulary (parallel_layers.py):
one all-reduce after the attention output and one after the MLP.

Under pipeline parallelism each stage builds only its decoder layers
(``PipelineGroup``/``stage_layers``; the others are weightless placeholders,
so checkpoint names keep their layer indices and are skipped): the first
stage owns the embedding, the last the final norm and the LM head (with tied
embeddings the last stage holds the embedding too, as its LM head). A stage
after the first starts from the hidden states and residual stream the
previous stage sent; a stage before the last returns them for the next.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_pod.attention.abstract import AttentionBackend, AttentionMetadata
from engine_pod.distributed.parallel_state import PipelineGroup, TensorParallelGroup, single_stage, stage_layers
from engine_pod.model.hf_config import ModelArchConfig
from engine_pod.model.layers import RMSNorm, silu_and_mul
from engine_pod.model.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_per_rank,
    qkv_shards,
    split_shards,
    vocab_parallel_logits,
)
from engine_pod.model.rotary import RotaryEmbedding, compute_inv_freq

# Model dtypes the layers' C++ kernels run (they compute in float, as torch does for these).
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# merged parameter -> (checkpoint projection, shard name)
STACKED_PARAMS = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", "gate"), ("up_proj", "up")),
}


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        # This rank's heads (all of them at TP=1).
        self.num_heads = cfg.num_attention_heads // group.world_size
        self.num_kv_heads = kv_heads_per_rank(cfg.num_key_value_heads, group.world_size)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        shards = qkv_shards(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, group)
        self.qkv_proj = MergedColumnParallelLinear(cfg.hidden_size, shards, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias, group=group
        )
        self.rotary = rotary
        self.backend = backend

    def forward(self, positions, hidden, kv_cache, md: AttentionMetadata, output_rows=None) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v.contiguous(), kv_cache, md, self.scale).reshape(-1, self.q_size)
        return self.o_proj(out if output_rows is None else out[output_rows])


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, group: TensorParallelGroup, cpu_kernels: bool = False) -> None:
        super().__init__()
        self.cpu_kernels = cpu_kernels
        shards = split_shards(["gate", "up"], cfg.intermediate_size, group)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, shards, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.cpu_kernels))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend, group: TensorParallelGroup,
        cpu_kernels: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, backend, group)
        self.mlp = LlamaMLP(cfg, group, cpu_kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cpu_kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cpu_kernels)

    def forward(
        self, positions, hidden, residual, kv_cache, md, output_rows=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream) for ``output_rows`` (all rows when
        None); the layer's output in HF's terms is their sum, which the next
        norm adds (``residual`` is None at the first layer: the embeddings
        are the stream). Every row's K/V is written either way; past the
        attention each row is computed on its own, so the other rows' o_proj
        and MLP are skipped."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            residual, normed = self.input_layernorm.add_and_norm(residual, hidden)
        attn = self.self_attn(positions, normed, kv_cache, md, output_rows)
        if output_rows is not None:
            residual = residual[output_rows]
        residual, normed = self.post_attention_layernorm.add_and_norm(residual, attn)
        return self.mlp(normed), residual


class PPMissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no weights, never called."""


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, max_model_len: int, dtype: torch.dtype, backend: AttentionBackend,
        group: TensorParallelGroup, pp: PipelineGroup, tie_word_embeddings: bool = False,
    ):
        super().__init__()
        self.is_first_stage, self.is_last_stage = pp.is_first_stage, pp.is_last_stage
        # The decoder layers this stage runs (all of them at PP=1).
        self.stage_layers = stage_layers(cfg.num_hidden_layers, pp.stage, pp.num_stages)
        inv_freq, scale = compute_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, max_model_len
        )
        # The cpu backend's build registered the layers' kernels too (float arithmetic: not for float64).
        cpu_kernels = backend.name == "cpu" and dtype in CPU_KERNEL_DTYPES
        # One table shared by every layer (not a parameter, not in the checkpoint).
        rotary = RotaryEmbedding(cfg.head_dim, max_model_len, inv_freq, scale, dtype, cpu_kernels)
        # The last stage's tied LM head is the embedding's weight.
        has_embedding = self.is_first_stage or (self.is_last_stage and tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group) if has_embedding else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, rotary, backend, group, cpu_kernels) if i in self.stage_layers
            else PPMissingLayer()
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cpu_kernels) if self.is_last_stage else None

    def forward(
        self, input_ids, positions, kv_caches: list[torch.Tensor], md: AttentionMetadata, output_rows=None,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last stage: residual + hidden of ``output_rows``. A stage
        before it: (hidden, residual) of every row, for the next stage.
        ``kv_caches`` are this stage's layers'; ``intermediate`` is what the
        previous stage sent (None on the first stage)."""
        if self.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        layers = self.layers[self.stage_layers.start : self.stage_layers.stop]
        last = len(layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
            # Only the model's last layer can drop rows: earlier ones feed every row's K/V onwards.
            rows = output_rows if i == last and self.is_last_stage else None
            hidden, residual = layer(positions, hidden, residual, kv_cache, md, rows)
        if not self.is_last_stage:
            return hidden, residual
        return residual + hidden


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, max_model_len: int, dtype: torch.dtype, backend: AttentionBackend,
        group: TensorParallelGroup, pp: PipelineGroup | None = None,
    ):
        super().__init__()
        self.config = cfg
        self.group = group
        self.pp = pp or single_stage(group)
        self.model = LlamaModel(cfg, max_model_len, dtype, backend, group, self.pp, cfg.tie_word_embeddings)
        if cfg.tie_word_embeddings or not self.pp.is_last_stage:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, group)

    def forward(self, input_ids, positions, kv_caches, md, output_rows: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Hidden states (before the final norm) of the tokens ``output_rows``
        selects (the ones that sample; every token when None): [rows, hidden].
        All tokens' K/V are cached either way. In a prefill step most tokens
        sample nothing, and skipping their last-layer o_proj and MLP saves
        about 1/num_layers of the step's GEMMs. Under PP a stage before the
        last returns (hidden, residual) of every token instead, and a stage
        after the first starts from the previous stage's (``intermediate``)."""
        return self.model(input_ids, positions, kv_caches, md, output_rows, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of selected hidden states, on the last stage's TP rank 0
        only (None on the others: they do not sample; only the last stage
        calls this). The final norm is per-row, so applying
        it to sampled positions only is exact and cheaper."""
        hidden = self.model.norm(hidden)
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return vocab_parallel_logits(hidden, head, self.config.vocab_size, self.group)
