"""How requests on adapters are scheduled: slots, the max_loras limit, the
host cache, and reads that never hold up other requests."""

from __future__ import annotations

import threading

import pytest

from engine_pod import LLM, LoRARequest, SamplingParams
from engine_pod.core.lora_slots import LoRASlotTable
from engine_pod.engine import lora_loader
from engine_pod.lora_request import AdapterSpec
from engine_pod.request import Request, RequestStatus

ENGINE_KW = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20, enable_lora=True)


def _spec(lora_id: int) -> AdapterSpec:
    return AdapterSpec(f"a{lora_id}", lora_id, "/x", 8, 2.0, ("q_proj",), f"{lora_id:064x}")


def _request(name: str, lora_id: int | None) -> Request:
    return Request(name, [1, 2, 3], SamplingParams(), lora=None if lora_id is None else _spec(lora_id))


# -- the slot table ------------------------------------------------------------
def test_fits_counts_the_adapters_of_running_requests():
    table = LoRASlotTable(2)
    running = [_request("r1", 1), _request("r2", 2), _request("r3", None)]
    assert table.fits(_request("n", 1), running)  # its adapter runs already
    assert table.fits(_request("n", None), running)  # the base model needs no slot
    assert not table.fits(_request("n", 3), running)
    assert table.fits(_request("n", 3), running[1:])


def test_assign_reuses_slots_and_evicts_the_least_recently_used():
    table = LoRASlotTable(2)
    slots, loads = table.assign([_request("a", 1), _request("b", None), _request("c", 2)])
    assert slots == {"a": 0, "c": 1} and loads == {0: 1, 1: 2}
    slots, loads = table.assign([_request("a", 1), _request("d", 2)])
    assert slots == {"a": 0, "d": 1} and loads == {}  # already in place: nothing to write
    table.assign([_request("c", 2)])  # adapter 1 is now the least recently used
    slots, loads = table.assign([_request("e", 3), _request("c", 2)])
    assert slots == {"e": 0, "c": 1} and loads == {0: 3}
    with pytest.raises(RuntimeError, match="more than max_loras=2"):
        table.assign([_request("x", 4), _request("y", 5), _request("z", 6)])


# -- in the engine -------------------------------------------------------------
def _loras(paths) -> list[LoRARequest]:
    return [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(paths)]


def _add(llm, name: str, prompt: list[int], lora: LoRARequest | None, max_tokens: int = 4) -> Request:
    request = Request(name, prompt, llm.processor.process_params(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                                ignore_eos=True)),
                      lora=llm.processor.process_lora(lora))
    llm.engine_core.add_request(request)
    return request


def test_max_loras_bounds_the_adapters_of_every_step(tiny_llama, tiny_llama_loras):
    llm = LLM(str(tiny_llama), **ENGINE_KW, max_loras=2, max_cpu_loras=3)
    seen: list[dict[str, int]] = []
    llm.engine_core.step_observer = lambda so, _seconds: seen.append(dict(so.lora_slots))
    loras = _loras(tiny_llama_loras)
    choices = [0, 1, 2, None, 2, 1, 0, None]
    outputs = llm.generate([{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(len(choices))],
                           SamplingParams(temperature=0.0, max_tokens=6),
                           lora_request=[None if c is None else loras[c] for c in choices])
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert seen and all(len(set(step.values())) <= 2 for step in seen)
    assert {s for step in seen for s in step.values()} == {0, 1}
    assert len(llm.engine_core.lora_loader.resident()) == 3


def test_the_host_cache_keeps_max_cpu_loras(tiny_llama, tiny_llama_loras):
    llm = LLM(str(tiny_llama), **ENGINE_KW, max_loras=1, max_cpu_loras=2)
    for lora in _loras(tiny_llama_loras):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), lora_request=lora)
    assert [s.name for s in llm.engine_core.lora_loader.resident()] == ["adapter-1", "adapter-2"]


def test_a_slow_read_holds_up_no_other_request(tiny_llama, tiny_llama_loras, monkeypatch):
    """While an adapter's files are read, the base model's requests (and those
    of adapters already loaded) run; the waiting request then runs as usual."""
    release = threading.Event()
    real_load = lora_loader.load_adapter_weights

    def slow_load(spec, dtype):
        assert release.wait(30), "the test never released the read"
        return real_load(spec, dtype)

    monkeypatch.setattr(lora_loader, "load_adapter_weights", slow_load)
    llm = LLM(str(tiny_llama), **ENGINE_KW, max_loras=2)
    lora = _loras(tiny_llama_loras)[0]
    waiting = _add(llm, "on-adapter", [5, 6, 7, 8], lora)
    base = _add(llm, "base", [9, 10, 11], None)
    assert waiting.status == RequestStatus.WAITING_FOR_LORA
    for _ in range(4):
        llm.engine_core.step()
    assert base.is_finished and base.num_output_tokens == 4
    assert waiting.status == RequestStatus.WAITING_FOR_LORA and waiting.num_computed_tokens == 0
    release.set()
    while llm.engine_core.has_unfinished_requests():
        llm.engine_core.step()
    monkeypatch.setattr(lora_loader, "load_adapter_weights", real_load)
    fresh = LLM(str(tiny_llama), **ENGINE_KW, max_loras=2)
    expected = fresh.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), lora_request=lora)
    assert waiting.output_token_ids == expected[0].outputs[0].token_ids


def test_an_adapter_that_cannot_be_read_ends_its_requests_only(tiny_llama, tiny_llama_loras, tmp_path):
    """Its files vanished between the check and the read: its requests end
    (aborted, with the cause in the log); the others finish."""
    import shutil

    copy = shutil.copytree(tiny_llama_loras[0], tmp_path / "adapter")
    llm = LLM(str(tiny_llama), **ENGINE_KW, max_loras=2)
    doomed = LoRARequest("doomed", 5, str(copy))
    spec = llm.processor.process_lora(doomed)
    shutil.rmtree(copy)
    request = Request("doomed", [5, 6, 7], llm.processor.process_params(SamplingParams(max_tokens=2)), lora=spec)
    llm.engine_core.add_request(request)
    other = _add(llm, "other", [8, 9], None, max_tokens=2)
    outputs = []
    while llm.engine_core.has_unfinished_requests():
        outputs += llm.engine_core.step()
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert any(o.request_id == "doomed" and o.finish_reason == "abort" for o in outputs)
    assert other.is_finished and other.num_output_tokens == 2


def test_a_hung_read_ends_its_requests_and_the_next_adapter_is_read(tiny_llama, tiny_llama_loras, monkeypatch):
    """An adapter's read never returns (a hung volume): past read_timeout_s
    its request ends; the adapter queued behind it is read by a new reader
    and its request gives the tokens a fresh engine gives; the hung adapter
    is refused at once for a while after."""
    import time

    release = threading.Event()
    real_load = lora_loader.load_adapter_weights
    hung_lora, next_lora = _loras(tiny_llama_loras)[:2]

    def load(spec, dtype):
        if spec.name == hung_lora.lora_name:
            release.wait(30)
        return real_load(spec, dtype)

    monkeypatch.setattr(lora_loader, "load_adapter_weights", load)
    llm = LLM(str(tiny_llama), **ENGINE_KW, max_loras=2)
    llm.engine_core.lora_loader.read_timeout_s = 0.5
    try:
        hung = _add(llm, "hung", [5, 6, 7, 8], hung_lora)
        queued = _add(llm, "queued", [5, 6, 7, 8], next_lora)
        outputs, deadline = [], time.monotonic() + 20
        while llm.engine_core.has_unfinished_requests() and time.monotonic() < deadline:
            outputs += llm.engine_core.step()
        assert hung.status == RequestStatus.FINISHED_ABORTED
        assert any(o.request_id == "hung" and o.finish_reason == "abort" for o in outputs)
        assert queued.is_finished and queued.num_output_tokens == 4
        with pytest.raises(ValueError, match="took over"):
            _add(llm, "again", [9, 10], hung_lora)
    finally:
        release.set()
    monkeypatch.setattr(lora_loader, "load_adapter_weights", real_load)
    fresh = LLM(str(tiny_llama), **ENGINE_KW, max_loras=2)
    expected = fresh.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), lora_request=next_lora)
    assert queued.output_token_ids == expected[0].outputs[0].token_ids
