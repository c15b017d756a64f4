"""An engine pod's adapters by name (engine_pod/server/lora_registry.py), without a process:
names checked, one folder per name, new ids for a name served again, run-time loads only from
the --lora-root folders (symlinks and `..` resolved first), and a bound on how many."""

from __future__ import annotations

import pytest

from engine_pod.config import create_engine_config
from engine_pod.processor import Processor
from engine_pod.server.lora_registry import (
    AdapterConflict,
    AdapterOutsideRoots,
    LoRADisabled,
    LoRARegistry,
    TooManyAdapters,
    parse_lora_modules,
)


@pytest.fixture
def processor(tiny_llama):
    config = create_engine_config(tiny_llama, dtype="float32", device="cpu", enable_lora=True, max_lora_rank=16)
    return Processor(config, tokenizer=None, eos_token_ids=set())


def test_names_folders_and_ids(processor, tiny_llama_loras):
    registry = LoRARegistry(processor, [])
    first = registry.register("a", str(tiny_llama_loras[0]), from_flags=True)
    assert registry.register("a", str(tiny_llama_loras[0]), from_flags=True) is first  # the same: a no-op
    with pytest.raises(AdapterConflict, match="already served from another folder"):
        registry.register("a", str(tiny_llama_loras[1]), from_flags=True)
    registry.unregister("a")
    again = registry.register("a", str(tiny_llama_loras[1]), from_flags=True)
    assert again.lora_int_id != first.lora_int_id and again.fingerprint != first.fingerprint
    with pytest.raises(KeyError):
        registry.unregister("never")
    with pytest.raises(ValueError, match="not a valid adapter name"):
        registry.register("white space", str(tiny_llama_loras[0]), from_flags=True)


def test_run_time_loads_stay_inside_the_roots(processor, tiny_llama_loras, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tiny_llama_loras[0], target_is_directory=True)
    registry = LoRARegistry(processor, [str(root)])
    for path in (str(root / "link"), str(root / ".." / "elsewhere"), str(tiny_llama_loras[0])):
        with pytest.raises(AdapterOutsideRoots, match="outside this pod's --lora-root"):
            registry.register("x", path)
    with pytest.raises(AdapterOutsideRoots, match="has none"):
        LoRARegistry(processor, []).register("x", str(tiny_llama_loras[0]))


def test_a_bound_on_served_adapters(processor, tiny_llama_loras):
    registry = LoRARegistry(processor, [], max_adapters=2)
    registry.register("a", str(tiny_llama_loras[0]), from_flags=True)
    registry.register("b", str(tiny_llama_loras[1]), from_flags=True)
    with pytest.raises(TooManyAdapters, match="already serves 2 adapters"):
        registry.register("c", str(tiny_llama_loras[2]), from_flags=True)


def test_an_engine_without_lora(tiny_llama, tiny_llama_loras):
    config = create_engine_config(tiny_llama, dtype="float32", device="cpu")
    with pytest.raises(LoRADisabled, match="without --enable-lora"):
        LoRARegistry(Processor(config, None, set()), []).register("a", str(tiny_llama_loras[0]), from_flags=True)


@pytest.mark.parametrize(("values", "match"), [
    (["a"], "is not NAME=PATH"), (["a="], "is not NAME=PATH"), (["a=/x", "a=/y"], "given twice"),
    (["b c=/x"], "not a valid adapter name"),
])
def test_lora_modules_flags(values, match):
    with pytest.raises(ValueError, match=match):
        parse_lora_modules(values)
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == [("a", "/x"), ("b", "/y=z")]
