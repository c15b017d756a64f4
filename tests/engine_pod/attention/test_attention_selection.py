"""How the engine picks its attention backend: by device and config, with a
clear start-up error (explicit triton or cpu) or a logged fallback (auto)
when the backend cannot run the model here."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from engine_pod.attention.selector import get_attention_backend

CPU = torch.device("cpu")
# Only the choice is made: nothing here touches a CUDA device, so these run
# without one.
CUDA = torch.device("cuda")
# On a CUDA machine the suite compiles the kernels for the GPU instead.
needs_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU runs of triton use the interpreter")


def test_auto_on_cpu_is_the_cpu_backend_even_under_the_interpreter():
    # tests/conftest.py sets TRITON_INTERPRET=1 here: auto must not pick the
    # interpreter, which is for tests only. This machine has a compiler, so
    # the C++ kernels build.
    assert get_attention_backend("auto", CPU, 64, torch.float32).name == "cpu"
    assert get_attention_backend("cpu", CPU, 80, torch.float64).name == "cpu"


def test_auto_on_cpu_falls_back_to_torch_when_the_kernels_cannot_build(caplog, monkeypatch):
    from engine_pod.attention.cpu_ops import build

    monkeypatch.setattr(build, "load_cpu_ops", lambda: "no C++ compiler (c++/g++) on PATH")
    with caplog.at_level(logging.WARNING, logger="engine_pod.attention.selector"):
        assert get_attention_backend("auto", CPU, 64, torch.float32).name == "torch"
    assert "no C++ compiler" in caplog.text and "using torch" in caplog.text
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run here: no C\\+\\+ compiler"):
        get_attention_backend("cpu", CPU, 64, torch.float32)


def test_explicit_cpu_on_a_gpu_is_refused():
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot run here: it runs on CPU engines"):
        get_attention_backend("cpu", CUDA, 128, torch.bfloat16)


def test_torch_is_torch():
    assert get_attention_backend("torch", CPU, 80, torch.float64).name == "torch"


@needs_interpreter
def test_explicit_triton_on_cpu_under_the_interpreter():
    assert get_attention_backend("triton", CPU, 128, torch.bfloat16).name == "triton"


def test_explicit_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend='triton'.*TRITON_INTERPRET=1"):
        get_attention_backend("triton", CPU, 64, torch.float32)


@pytest.mark.parametrize(
    "head_size, dtype, message",
    [(80, torch.float32, "head size 80 is not supported"), (64, torch.float64, "dtype float64 is not supported")],
)
def test_explicit_triton_rejects_unsupported_models(head_size, dtype, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=f"attention_backend='triton'.*{message}"):
        get_attention_backend("triton", CUDA, head_size, dtype)


def test_auto_on_cuda_falls_back_to_torch_with_a_warning(caplog, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level(logging.WARNING, logger="engine_pod.attention.selector"):
        backend = get_attention_backend("auto", CUDA, 96, torch.bfloat16)
    assert backend.name == "torch"
    assert "head size 96 is not supported" in caplog.text and "using torch" in caplog.text


def test_cuda_with_the_interpreter_on_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 is set: the kernels would run in the CPU interpreter"):
        get_attention_backend("triton", CUDA, 128, torch.bfloat16)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="attention_backend: 'flash' is not one of"):
        get_attention_backend("flash", CPU, 64, torch.float32)


def test_kernels_imported_before_the_interpreter_was_set_are_refused():
    code = (
        "import os, torch\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "import engine_pod.attention.triton_ops.cache_write\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from engine_pod.attention.selector import get_attention_backend\n"
        "get_attention_backend('triton', torch.device('cpu'), 64, torch.float32)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "imported before TRITON_INTERPRET=1 was set" in result.stderr


def test_engine_flag_reaches_the_engine_config():
    import argparse

    from engine_pod.entrypoints.cli_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "m", "--attention-backend", "triton"])
    assert engine_kwargs(args)["attention_backend"] == "triton"
    assert engine_kwargs(parser.parse_args(["--model", "m"]))["attention_backend"] == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--attention-backend", "flash"])
