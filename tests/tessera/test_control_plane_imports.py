"""The control plane runs without the engine: each of its entry points,
imported in a fresh interpreter, loads neither torch nor xgrammar nor
engine_pod (the import-linter contract checks the code; this checks what
third-party imports pull in, such as transformers importing torch)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gateway.process import GatewayProcess
from tessera.child_process import free_port

ENGINE_ONLY = ("torch", "xgrammar", "engine_pod")
ROOT = Path(__file__).resolve().parent.parent.parent


def _loaded_after(code: str) -> list[str]:
    """Which of ENGINE_ONLY a fresh interpreter has loaded after running `code`
    (a None entry, a module made unimportable, counts as absent)."""
    check = (f"import sys\n{code}\n"
             f"print('loaded:' + ','.join(m for m in {ENGINE_ONLY!r} if sys.modules.get(m) is not None))")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    loaded = proc.stdout.splitlines()[-1].removeprefix("loaded:")
    return [m for m in loaded.split(",") if m]


@pytest.mark.parametrize("module", ["gateway.main", "gateway.cli", "tessera_operator.main", "tessera_tools.cli"])
def test_importing_an_entry_point_loads_no_engine(module):
    assert _loaded_after(f"import {module}") == []


@pytest.mark.parametrize("argv", [["gateway", "--help"], ["api-key", "--help"], ["operator", "--help"], ["--help"]])
def test_the_cli_parses_a_control_plane_command_without_the_engine(argv):
    code = f"from tessera_tools import cli\ntry:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass"
    assert _loaded_after(code) == []


def test_api_key_runs_without_the_engine():
    code = "from tessera_tools import cli\nassert cli.main(['api-key', '--tenant', 'x']) == 0"
    assert _loaded_after(code) == []


def test_the_gateway_tokenizes_without_torch(tiny_llama):
    """What `tessera gateway` does first (gateway/cli.py), then the model load."""
    code = ("from tessera.text.torch_free import hide_torch_from_transformers\n"
            "assert hide_torch_from_transformers()\n"
            "from gateway.config import ModelConfig\nfrom gateway.model import ServedModel\n"
            f"m = ServedModel.load(ModelConfig('tiny', {str(tiny_llama)!r}))\n"
            "assert m.encode_chat([{'role': 'user', 'content': 'hi'}])")
    assert _loaded_after(code) == []


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
    except urllib.error.HTTPError:
        return True  # 503: no engine pod, but the gateway is up
    except OSError:
        return False
    return True


def test_a_running_gateway_maps_no_engine_library(tiny_llama, tmp_path):
    """`tessera gateway` itself, serving: neither libtorch nor xgrammar in its memory maps."""
    config = {"model": {"name": "tiny", "path": str(tiny_llama)},
              "pods": {"static": [{"address": f"127.0.0.1:{free_port()}", "role": "mixed"}]}}
    with GatewayProcess(config, tmp_path, log_path=tmp_path / "gateway.log") as gw:
        deadline = time.monotonic() + 60
        while not _answers(gw.base_url + "/health"):
            gw.check_alive("gateway")
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        maps = Path(f"/proc/{gw.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "xgrammar" not in maps
