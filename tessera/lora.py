"""What every layer agrees on about LoRA adapters: what an adapter may be
called and the ranks an engine sizes its slots for. The engine pods, the
gateway and the operator's CRD all take these from here, so a name one of
them accepts, every one accepts."""

from __future__ import annotations

import re

# An adapter's name: what clients send as the OpenAI `model` to use it, and a metric label value.
MAX_LORA_NAME_LEN = 256
LORA_NAME_CHARS = "A-Za-z0-9._:/@+-"
LORA_NAME_RE = re.compile(rf"[{LORA_NAME_CHARS}]{{1,{MAX_LORA_NAME_LEN}}}")
LORA_NAME_RULE = f"1-{MAX_LORA_NAME_LEN} letters, digits or . _ - : / @ +"

# The ranks an engine accepts as max_lora_rank (vLLM's list).
SUPPORTED_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
