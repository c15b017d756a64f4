"""Which LoRA adapter a request runs on: the caller's name for it, and what the
engine checked about it.

``LoRARequest`` is vLLM's: a name, an id unique per adapter within one engine,
and the folder in the PEFT layout. ``AdapterSpec`` is what the engine made of
that folder once it checked it (engine_pod/lora/adapter.py); a request carries
it from then on, so the scheduler, the KV cache and the runner never read the
folder again. Both are plain data: the scheduler side imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# The projections an adapter may target, by their names in Hugging Face checkpoints.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to run a request on (vLLM's ``LoRARequest``)."""

    lora_name: str
    """The adapter's name, as clients call it (the OpenAI ``model`` field at the gateway)."""
    lora_int_id: int
    """A positive id naming this adapter inside one engine: one id, one adapter."""
    lora_path: str
    """The adapter's folder: ``adapter_config.json`` and ``adapter_model.safetensors``."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request: lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_request: lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_request: lora_path must be a non-empty string")


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter folder the engine has read and checked against its model."""

    name: str
    """The LoRARequest's lora_name."""
    lora_int_id: int
    """The LoRARequest's id: the key of the engine's adapter caches."""
    path: str
    """The folder it was read from."""
    rank: int
    """r: the rank of every low-rank pair (at most the engine's max_lora_rank)."""
    scaling: float
    """What the low-rank product is multiplied by: lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA)."""
    target_modules: tuple[str, ...]
    """The projections it changes, a subset of LORA_TARGET_MODULES."""
    fingerprint: str
    """SHA-256 (hex) of its config and weight files: the adapter's identity in
    block hashes, so KV computed under one adapter's weights is never served
    under other weights, whatever the name (kv_store/block_hash.py)."""
