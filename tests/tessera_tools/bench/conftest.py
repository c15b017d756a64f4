"""A stand-in `vllm` package in a stand-in virtual environment, for the benchmarks run against
vLLM (test_vllm_peer.py, test_prefix_cache_peer.py): the worker's only import, in a real child
process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# A library every Linux process already maps: harmless to preload in place of tcmalloc and libiomp5.
HARMLESS_LIBRARY = Path("/lib/x86_64-linux-gnu/libm.so.6")

FAKE_VLLM = '''
import json, os, sys, time
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        self.max_tokens = max_tokens

class LLM:
    def __init__(self, **settings):
        self.log_stats = not settings["disable_log_stats"]
        print("a log line on stdout")  # must not be taken for an answer
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            env = {k: os.environ[k] for k in ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE",
                                              "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")
                   if k in os.environ}
            json.dump({"settings": settings, "env": env,
                       "tessera_vars": sorted(k for k in os.environ if k.startswith("TESSERA_"))}, f)

    def generate(self, prompts, params, use_tqdm):
        print("another log line")
        if params[0].max_tokens == 999:
            time.sleep(60)
        if params[0].max_tokens == 998:
            sys.exit(3)
        return [_Output(p["prompt_token_ids"], q.max_tokens, self.log_stats) for p, q in zip(prompts, params)]

class _Output:
    def __init__(self, prompt, n, log_stats):
        self.outputs = [type("Completion", (), {"token_ids": [(sum(prompt) + i) % 97 for i in range(n)]})]
        self.num_cached_tokens = len(prompt) // 2
        # vLLM's RequestStateStats only when its engine logs stats
        self.metrics = type("Stats", (), {"first_token_latency": 0.25})() if log_stats else None
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A virtual environment whose python sees the stand-in vllm package."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (site / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                              "    return {'prompt_token_ids': prompt_token_ids}\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "lib" / "libiomp5.so").symlink_to(HARMLESS_LIBRARY)
    # The stand-in, and torch (a real vLLM environment has its own) for the profiled generate.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(Path(torch.__file__).parents[1])]))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    monkeypatch.setenv("TESSERA_INTERNAL_SECRET", "not-for-the-peer-" + "x" * 32)
    return venv, tmp_path / "record.json"
