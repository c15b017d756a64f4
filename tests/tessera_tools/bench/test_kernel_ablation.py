"""`tessera bench throughput --ablate`: a CPU kernel off and on in one engine, alternated rounds,
both sides reported; switching a kernel off really takes the other path, and is undone."""

from __future__ import annotations

import json

import pytest

from engine_pod import LLM
from tessera_tools.bench.kernel_ablation import kernel_switched_off
from tessera_tools.cli import main


@pytest.mark.parametrize("kernel", ["layer-kernels", "prefill-kernel"])
def test_the_command_reports_both_sides(tiny_llama, tmp_path, kernel):
    out = tmp_path / "ablation.json"
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--num-requests", "4", "--max-prompt-len", "32",
                 "--max-output-len", "4", "--kv-cache-gib", "1", "--ablate", kernel, "--rounds", "2",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())["ablation"]
    assert report["kernel"] == kernel and report["requests"] == 4
    assert len(report["on_tokens_per_second"]) == len(report["off_tokens_per_second"]) == 2
    assert report["ratio_of_medians"] == pytest.approx(report["on_median"] / report["off_median"])
    assert 0 <= report["identical_outputs"] <= 4


def test_switching_off_takes_the_torch_paths_and_is_undone(tiny_llama, monkeypatch):
    with LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20) as llm:
        runner = llm.engine_core.executor.runner
        with kernel_switched_off(llm, "layer-kernels"):
            assert not any(getattr(m, "cpu_kernels", False) for m in runner.model.modules())
        assert all(layer.mlp.cpu_kernels for layer in runner.model.model.layers)

        calls = []
        monkeypatch.setattr("torch.ops.tessera_cpu.prefill_attention", lambda *a: calls.append(a), raising=False)
        with kernel_switched_off(llm, "prefill-kernel"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
        assert calls == [] and runner.backend.prefill_kernels  # switched back on
        llm.generate([{"prompt_token_ids": [8, 9, 10]}], use_tqdm=False)  # switched back on: the kernel runs
        assert len(calls) == runner.model.config.num_hidden_layers


def test_an_engine_without_the_kernel_is_refused(tiny_llama):
    with LLM(str(tiny_llama), dtype="float64", max_model_len=128, kv_cache_memory_bytes=8 << 20) as llm:
        with pytest.raises(ValueError, match="does not run the layers' CPU kernels"):
            with kernel_switched_off(llm, "layer-kernels"):
                pass


def test_the_prefill_kernel_cannot_be_ablated_on_the_torch_backend(tiny_llama):
    with LLM(str(tiny_llama), dtype="float32", attention_backend="torch", max_model_len=128,
             kv_cache_memory_bytes=8 << 20) as llm:
        with pytest.raises(ValueError, match="runs the torch attention backend, not cpu"):
            with kernel_switched_off(llm, "prefill-kernel"):
                pass
