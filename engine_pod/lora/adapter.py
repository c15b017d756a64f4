"""Read a PEFT LoRA adapter folder and check it against the model it will run on.

``inspect_adapter`` is what the engine runs when a request first names an
adapter: every way the folder can be wrong (missing, malformed, a rank above
max_lora_rank, projections the model does not have, shapes of another base
model, PEFT options the engine does not implement) is a ValueError naming the
file and the field, before anything is scheduled. The weights are then read
by ``load_adapter_weights`` (off the step loop: engine/lora_loader.py), which
checks that the bytes are still the ones inspected, so an adapter swapped on
disk in between can never run under the first one's identity.

The safetensors header is parsed here by hand (8-byte length, then JSON): it
needs no torch, and a hostile file gets a clear error, not a crash.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine_pod.lora_request import LORA_TARGET_MODULES, AdapterSpec, LoRARequest

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Larger config files or safetensors headers are refused rather than parsed.
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
# PEFT's saved names: base_model.model.<the model's module path>.lora_A.weight
_WEIGHT_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
# PEFT options that change the arithmetic and that the engine does not implement: (key, value that is fine).
_UNSUPPORTED = (
    ("use_dora", False), ("fan_in_fan_out", False), ("modules_to_save", None), ("layers_to_transform", None),
    ("rank_pattern", {}), ("alpha_pattern", {}), ("bias", "none"),
)


class ModelArchConfig(Protocol):
    """The shape of the base model (engine_pod/model/hf_config.ModelArchConfig; the
    model layer sits above this one, so it is named by what it must have)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int


@dataclass(frozen=True)
class _Tensor:
    name: str
    layer: int
    module: str
    factor: str  # "A" or "B"
    shape: tuple[int, ...]


def projection_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one layer, unsharded."""
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def inspect_adapter(request: LoRARequest, arch: ModelArchConfig, max_lora_rank: int) -> AdapterSpec:
    """Check the folder ``request.lora_path`` against ``arch``; raises ValueError."""
    folder = Path(request.lora_path)
    where = f"LoRA adapter {request.lora_name!r} ({folder})"
    if not folder.is_dir():
        raise ValueError(f"{where}: no such adapter folder")
    config_bytes = _read_bounded(folder / CONFIG_FILE, MAX_CONFIG_BYTES, where)
    weights_bytes = _read_weights(folder, where)
    config = _parse_config(config_bytes, where)
    rank, scaling, targets = _check_config(config, arch, max_lora_rank, where)
    tensors = _parse_header(weights_bytes, where)
    _check_tensors(tensors, rank, targets, arch, where)
    return AdapterSpec(
        name=request.lora_name, lora_int_id=request.lora_int_id, path=str(folder), rank=rank, scaling=scaling,
        target_modules=targets, fingerprint=fingerprint(config_bytes, weights_bytes),
    )


def fingerprint(config_bytes: bytes, weights_bytes: bytes) -> str:
    h = hashlib.sha256(b"tessera-lora-v1")
    for part in (config_bytes, weights_bytes):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


# -- the config ------------------------------------------------------------
def _read_bounded(path: Path, limit: int, where: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise ValueError(f"{where}: {path.name} is missing") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read {path.name}: {e.strerror}") from None
    if len(data) > limit:
        raise ValueError(f"{where}: {path.name} is larger than {limit} bytes")
    return data


def _read_weights(folder: Path, where: str) -> bytes:
    path = folder / WEIGHTS_FILE
    if not path.is_file() and (folder / "adapter_model.bin").is_file():
        raise ValueError(f"{where}: only {WEIGHTS_FILE} is read, not the pickled adapter_model.bin")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{where}: {WEIGHTS_FILE} is missing") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read {WEIGHTS_FILE}: {e.strerror}") from None


def _parse_config(data: bytes, where: str) -> dict[str, Any]:
    try:
        config = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(
    config: dict[str, Any], arch: ModelArchConfig, max_lora_rank: int, where: str
) -> tuple[int, float, tuple[str, ...]]:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type is {peft_type!r}; only LORA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"{where}: its rank r={rank} exceeds this engine's max_lora_rank={max_lora_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    for key, fine in _UNSUPPORTED:
        value = config.get(key, fine)
        if value != fine and not (fine is None and not value):
            raise ValueError(f"{where}: {key}={value!r} is not supported (only {fine!r})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), _targets(config.get("target_modules"), where)


def _targets(value: object, where: str) -> tuple[str, ...]:
    if value == "all-linear":
        return LORA_TARGET_MODULES
    if isinstance(value, str):
        raise ValueError(f"{where}: target_modules as a pattern ({value!r}) is not supported; list the projections")
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: target_modules must be a non-empty list of projection names")
    # PEFT matches a name as a suffix of the module path: "self_attn.q_proj" means q_proj.
    names = {v.rsplit(".", 1)[-1] for v in value}
    unknown = sorted(names - set(LORA_TARGET_MODULES))
    if unknown:
        raise ValueError(f"{where}: target_modules {unknown} are not projections of this model "
                         f"(it has {', '.join(LORA_TARGET_MODULES)})")
    return tuple(m for m in LORA_TARGET_MODULES if m in names)


# -- the weights -------------------------------------------------------------
def _parse_header(data: bytes, where: str) -> list[_Tensor]:
    """The tensors a safetensors file declares, checked against its length."""
    if len(data) < 8:
        raise ValueError(f"{where}: {WEIGHTS_FILE} is not a safetensors file (too short)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(MAX_HEADER_BYTES, len(data) - 8):
        raise ValueError(f"{where}: {WEIGHTS_FILE} is not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{where}: {WEIGHTS_FILE} has a malformed safetensors header") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: {WEIGHTS_FILE} has a malformed safetensors header")
    body = len(data) - 8 - header_len
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors.append(_check_entry(name, entry, body, where))
    return tensors


def _check_entry(name: str, entry: object, body: int, where: str) -> _Tensor:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: {WEIGHTS_FILE}: entry {name!r} is malformed")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"{where}: tensor {name!r} has dtype {dtype!r}; adapters must be F32, F16, BF16 or F64")
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)):
        raise ValueError(f"{where}: tensor {name!r} must be a matrix, got shape {shape!r}")
    nbytes = shape[0] * shape[1] * _SAFETENSORS_DTYPES[dtype]
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= body or offsets[1] - offsets[0] != nbytes):
        raise ValueError(f"{where}: tensor {name!r} has data offsets {offsets!r} outside the file or of the wrong size")
    match = _WEIGHT_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{where}: tensor {name!r} is not a LoRA factor of a projection this engine serves "
                         "(embeddings, the LM head and extra modules are not supported)")
    layer, parent, module, factor = match.groups()
    if _MODULE_PARENT.get(module) != parent:
        raise ValueError(f"{where}: tensor {name!r} names a module the model does not have")
    return _Tensor(name, int(layer), module, factor, (shape[0], shape[1]))


def _check_tensors(
    tensors: list[_Tensor], rank: int, targets: tuple[str, ...], arch: ModelArchConfig, where: str
) -> None:
    shapes = projection_shapes(arch)
    seen: dict[tuple[int, str], set[str]] = {}
    for t in tensors:
        if t.layer >= arch.num_hidden_layers:
            raise ValueError(f"{where}: tensor {t.name!r} is for layer {t.layer}; the model has "
                             f"{arch.num_hidden_layers} layers (was it trained on another base model?)")
        if t.module not in targets:
            raise ValueError(f"{where}: tensor {t.name!r} is for {t.module}, not in its target_modules")
        in_features, out_features = shapes[t.module]
        want = (rank, in_features) if t.factor == "A" else (out_features, rank)
        if t.shape != want:
            raise ValueError(
                f"{where}: tensor {t.name!r} has shape {list(t.shape)}, this model needs {list(want)} "
                f"(r={rank}; a mismatch means an adapter of another base model)"
            )
        seen.setdefault((t.layer, t.module), set()).add(t.factor)
    if not seen:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    for (layer, module), factors in sorted(seen.items()):
        if factors != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{'A' if 'A' not in factors else 'B'} missing")


# -- loading -----------------------------------------------------------------
@dataclass
class AdapterWeights:
    """One adapter's low-rank factors, unsharded, in the compute dtype: per
    (layer, projection) A [r, in_features] and B [out_features, r]."""

    spec: AdapterSpec
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def lora_compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype adapters are read in, and the Triton path sums in: float32
    for 16-bit models, as Hugging Face PEFT up-casts 16-bit adapter weights,
    else the model's (the CPU path computes in the model's dtype: punica.py)."""
    import torch

    return torch.float64 if model_dtype == torch.float64 else torch.float32


def load_adapter_weights(spec: AdapterSpec, model_dtype: torch.dtype) -> AdapterWeights:
    """Read the factors of an inspected adapter; ValueError when its files
    changed since (another identity) or cannot be read."""
    from safetensors.torch import load as load_safetensors

    folder = Path(spec.path)
    where = f"LoRA adapter {spec.name!r} ({folder})"
    config_bytes = _read_bounded(folder / CONFIG_FILE, MAX_CONFIG_BYTES, where)
    weights_bytes = _read_weights(folder, where)
    if fingerprint(config_bytes, weights_bytes) != spec.fingerprint:
        raise ValueError(f"{where}: its files changed after it was checked; load it again under a new id")
    dtype = lora_compute_dtype(model_dtype)
    tensors = load_safetensors(weights_bytes)
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _WEIGHT_NAME.fullmatch(name)
        if match is None or match.group(4) != "A":
            continue
        layer, module = int(match.group(1)), match.group(3)
        b = tensors[name[: -len("lora_A.weight")] + "lora_B.weight"]
        factors[(layer, module)] = (tensor.to(dtype).contiguous(), b.to(dtype).contiguous())
    return AdapterWeights(spec, factors)
