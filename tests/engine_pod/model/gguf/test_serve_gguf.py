"""`LLM(model=FILE.gguf)` (and so `tessera engine --model FILE.gguf`, which builds its config the
same way) serves the file directly: converted once into a cache folder keyed by its digest."""

from __future__ import annotations

import threading

import pytest

from engine_pod import LLM, SamplingParams
from engine_pod.model.gguf import cache
from engine_pod.model.gguf.convert import import_gguf

PROMPTS = [[5, 100, 2000, 37], [8000, 12, 99, 400, 3, 1500, 7]]


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _greedy(model) -> list[list[int]]:
    with LLM(str(model), dtype="float32", block_size=16) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12))
        return [o.outputs[0].token_ids for o in outs]


def test_gguf_file_serves_as_its_imported_folder(tiny_gguf_q8, gguf_cache, tmp_path):
    folder = import_gguf(tiny_gguf_q8, tmp_path / "imported")
    assert _greedy(tiny_gguf_q8) == _greedy(folder)
    converted = cache.resolve_model_path(tiny_gguf_q8)
    assert converted.parent == gguf_cache / cache.file_digest(tiny_gguf_q8)
    assert converted.name == "tiny-gguf.Q8_0"  # what a pod reports as its model's name


def test_converted_once_and_again_when_the_file_changes(tiny_gguf_base, tiny_gguf_q8, gguf_cache, tmp_path):
    first = cache.resolve_model_path(tiny_gguf_q8)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cache.resolve_model_path(tiny_gguf_q8) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    changed = tmp_path / tiny_gguf_q8.name
    from tessera_tools.fixtures.make_gguf import Q, make_gguf

    make_gguf(tiny_gguf_base, changed, Q.Q4_0)
    assert cache.resolve_model_path(changed) != first


def test_concurrent_first_loads_convert_once(tiny_gguf_q8, gguf_cache, monkeypatch):
    calls = []
    real = import_gguf

    def counting(path, out, dtype="auto"):
        calls.append(out)
        return real(path, out, dtype)

    monkeypatch.setattr("engine_pod.model.gguf.convert.import_gguf", counting)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.resolve_model_path(tiny_gguf_q8)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3


def test_a_folder_is_served_as_it_is(tiny_gguf_base):
    assert cache.resolve_model_path(tiny_gguf_base) == tiny_gguf_base
