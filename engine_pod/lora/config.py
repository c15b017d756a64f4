"""How many LoRA adapters an engine serves at once (vLLM's knobs and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.lora import SUPPORTED_MAX_LORA_RANKS



@dataclass
class LoRAConfig:
    """LoRA serving: present only when the engine was started with enable_lora."""

    max_loras: int = 1
    """Adapters whose weights are in the model's slots at once: one step mixes
    requests of at most this many adapters (and of the base model)."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have; the slots are sized by it."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded in host memory (least recently used evicted);
    None: max_loras. Never fewer than max_loras."""
    read_timeout_s: float = 120.0
    """Seconds an adapter's files may take to read (a hung network volume):
    past it the requests waiting on it end, and later reads go on."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer, got {self.max_loras!r}")
        if self.max_lora_rank not in SUPPORTED_MAX_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {', '.join(map(str, SUPPORTED_MAX_LORA_RANKS))}, "
                f"got {self.max_lora_rank!r}"
            )
        if not self.read_timeout_s > 0:
            raise ValueError(f"LoRA read_timeout_s must be > 0 seconds, got {self.read_timeout_s!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer at least max_loras ({self.max_loras})"
            )

    @property
    def host_capacity(self) -> int:
        """max_cpu_loras, resolved."""
        assert self.max_cpu_loras is not None
        return self.max_cpu_loras
