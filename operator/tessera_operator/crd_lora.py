"""The LoRA sections of the InferenceService spec: `spec.loras` (the adapters, by name, and where
their folders live) and `spec.engine.lora` (how many the engine pods hold at once).

The engine's and the gateway's rules are spelled out here (the operator imports neither the
engine, which pulls in torch, nor the gateway's config); tests/operator/test_loras.py checks
they agree with engine_pod/lora/config.py and gateway/config.py.
"""

from __future__ import annotations

from tessera.lora import LORA_NAME_CHARS, MAX_LORA_NAME_LEN, SUPPORTED_MAX_LORA_RANKS
from tessera_operator.schema_dsl import ONE_SOURCE_RULE, Schema, array, folder_sources, integer, obj, string

# What an adapter may be called: the OpenAI `model` value that selects it, and a metric label
# (tessera/lora.py, the rule the engine pods and the gateway apply too).
NAME_PATTERN = rf"^[{LORA_NAME_CHARS}]+$"
MAX_NAME_LENGTH = MAX_LORA_NAME_LEN
# Every adapter is a model of its own in /v1/models and one more `--lora-modules` item; past a
# few dozen, adapters belong to run-time loading (engine.lora.runtimeRoots).
MAX_ADAPTERS = 64
MAX_RUNTIME_ROOTS = 8
# vLLM's knobs, with the engine's defaults (engine_pod/lora/config.py).
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16

CPU_LORAS_RULE = "!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras"
# Rules on the spec (they read model.name, loras and engine.lora together).
LORA_NAMES_RULE = "!has(self.loras) || self.loras.all(a, a.name != self.model.name)"
LORA_SETTINGS_RULE = ("!has(self.engine.lora) || (has(self.loras) && size(self.loras) > 0) || "
                      "size(self.engine.lora.runtimeRoots) > 0")


def loras_schema() -> Schema:
    adapter = obj("A LoRA adapter: a PEFT folder (adapter_config.json, adapter_model.safetensors) trained on the "
                  "base model, served beside it under a name of its own. Set exactly one of pvc and hostPath.", {
        "name": string("What clients put in the `model` field to use the adapter; /v1/models lists it with the "
                       "base model as its parent.", min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN),
        **folder_sources(
            "Adapter folder on a PersistentVolumeClaim: model.pvc's claim (its volume at /models serves, nothing "
            "more is mounted) or another (mounted read-only once under /loras, however many adapters it holds).",
            "Adapter folder inside the volume, relative to its root (empty: the root).",
            "Adapter folder present on every node (single-node clusters), mounted read-only under /loras.",
            "Absolute path of the adapter folder."),
    }, required=["name"], rules=[(ONE_SOURCE_RULE, "set exactly one of pvc and hostPath (where the adapter's "
                                                   "folder is)")])
    return array("LoRA adapters every engine pod (both pools in disaggregated mode) serves from the start, unique "
                 "by name; the gateway routes a request to one by its `model` field. Each adapter must fit "
                 "engine.lora.maxLoraRank.", adapter, max_items=MAX_ADAPTERS, map_keys=["name"])


def engine_lora_schema() -> Schema:
    root = obj("A folder whose adapter folders may be loaded at run time.", folder_sources(
        "Folder on a PersistentVolumeClaim (model.pvc's claim shares its volume; another is mounted read-only "
        "under /loras).",
        "Folder inside the volume, relative to its root (empty: the root).",
        "Folder present on every node (single-node clusters), mounted read-only under /loras.",
        "Absolute path of the folder."),
        rules=[(ONE_SOURCE_RULE, "set exactly one of pvc and hostPath (where the folder is)")])
    return obj("LoRA serving capacity of every engine pod (vLLM's knobs). Absent: these defaults whenever loras "
               "lists adapters; set it only with adapters in loras or folders in runtimeRoots.", {
        "maxLoras": integer("Adapters one engine step may mix (their weights in the model's slots at once); "
                            "requests on further adapters wait for a slot.", default=DEFAULT_MAX_LORAS, minimum=1),
        "maxLoraRank": integer("Largest adapter rank accepted; sizes the slots (an adapter of a higher rank is "
                               "refused).", default=DEFAULT_MAX_LORA_RANK, enum=list(SUPPORTED_MAX_LORA_RANKS)),
        "maxCpuLoras": integer("Adapters kept read into host memory, least recently used evicted (absent: "
                               "maxLoras).", minimum=1),
        "runtimeRoots": array("Folders the gateway's admin endpoint (/v1/load_lora_adapter) may load adapters "
                              "from at run time (--lora-root), mounted read-only; empty: run-time loads are "
                              "refused. Adapters loaded so live in the pods' memory: a pod started later serves "
                              "only loras.", root, default=[], max_items=MAX_RUNTIME_ROOTS),
    }, rules=[(CPU_LORAS_RULE, "maxCpuLoras must be at least maxLoras (the adapters of a step are in host "
                               "memory too)")])
