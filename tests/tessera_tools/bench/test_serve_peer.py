"""`tessera bench serve --peer vllm` without vLLM: the real Tessera platform (engine pod and
gateway on the tiny checkpoint) against a stand-in for vLLM's server module, a small
OpenAI-style streaming server run by the same interpreter the peer's environment would use; the
verdict's arithmetic as pure functions. What these cannot show is that vLLM's own server still
takes these flags: the benchmark itself (make vllm-venv) shows that."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tessera_tools.bench.flags import core_count
from tessera_tools.bench.peers.vllm_peer import VLLMSettings
from tessera_tools.bench.peers.vllm_server import SERVER_MODULE, VLLMServer, http_status, serve_argv
from tessera_tools.bench.serve.peer import (
    checkpoint_dtype,
    median_of_rounds,
    sustains,
    tessera_pod_args,
    verdict,
)

from .conftest import HARMLESS_LIBRARY

FAKE_SERVER = r'''
import argparse, json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
p.add_argument("--served-model-name")
args, _ = p.parse_known_args()
# An "engine core" child, as vLLM's server has: stopping the server must stop it too.
core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
    env = {k: os.environ[k] for k in ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    json.dump({"argv": sys.argv[1:], "env": env, "pids": [os.getpid(), core.pid],
               "tessera_vars": sorted(k for k in os.environ if k.startswith("TESSERA_"))}, f)
if os.environ.get("FAKE_VLLM_EXIT"):
    sys.exit(int(os.environ["FAKE_VLLM_EXIT"]))

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _json(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json({})
        else:
            self._json({"data": [{"id": args.served_model_name}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            time.sleep(0.002)
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.close_connection = True

ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
'''


@pytest.fixture
def fake_vllm_server(tmp_path, monkeypatch):
    """A virtual environment whose python runs the stand-in as vLLM's server module."""
    site = tmp_path / "site"
    module = site.joinpath(*SERVER_MODULE.split(".")).with_suffix(".py")
    module.parent.mkdir(parents=True)
    for folder in (site / "vllm", site / "vllm" / "entrypoints", module.parent):
        (folder / "__init__.py").write_text("")
    module.write_text(FAKE_SERVER)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "lib" / "libiomp5.so").symlink_to(HARMLESS_LIBRARY)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    monkeypatch.setenv("TESSERA_INTERNAL_SECRET", "not-for-the-peer-" + "x" * 32)
    return venv, tmp_path / "record.json"


def _settings(**overrides) -> VLLMSettings:
    fields = {"model": "/models/bench", "dtype": "bfloat16", "max_num_seqs": 64, "max_num_batched_tokens": 1024,
              "enable_prefix_caching": True, "seed": 3, "max_model_len": None, "kv_cache_gib": 2, "cpus": "0-1"}
    return VLLMSettings(**{**fields, **overrides})


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_server_gets_the_settings_in_vllms_flags_and_its_cpu_setup(fake_vllm_server, tmp_path):
    venv, record = fake_vllm_server
    with VLLMServer(_settings(), "bench", log_path=tmp_path / "vllm.log", venv=venv,
                    tcmalloc=HARMLESS_LIBRARY) as server:
        server.wait_ready(timeout_s=30)
        assert http_status(server.base_url + "/models") == 200
        seen = json.loads(record.read_text())
    # What the module sees after `python -m MODULE`.
    assert seen["argv"] == ["--model", "/models/bench", "--host", "127.0.0.1", "--port", str(server.port),
                            "--served-model-name", "bench", "--dtype", "bfloat16", "--max-num-seqs", "64",
                            "--max-num-batched-tokens", "1024", "--seed", "3", "--enable-prefix-caching",
                            "--disable-uvicorn-access-log"]
    assert seen["env"] == {"LD_PRELOAD": f"{HARMLESS_LIBRARY} {venv / 'lib' / 'libiomp5.so'}",
                           "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert seen["tessera_vars"] == [], "no Tessera variable (the internal secret) reaches the peer"
    assert all(_gone(pid) for pid in seen["pids"]), "closing stops the server and its engine core"


def test_the_argv_names_each_setting():
    argv = serve_argv(Path("/v/bin/python"), _settings(enable_prefix_caching=False, max_model_len=512), "m", 8001)
    assert argv[:5] == ["/v/bin/python", "-m", SERVER_MODULE, "--model", "/models/bench"]
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert argv[argv.index("--max-model-len") + 1] == "512" and argv[argv.index("--port") + 1] == "8001"


def test_a_server_that_exits_or_is_missing_is_named(fake_vllm_server, tmp_path, monkeypatch):
    venv, _ = fake_vllm_server
    monkeypatch.setenv("FAKE_VLLM_EXIT", "4")
    with VLLMServer(_settings(), "bench", venv=venv, tcmalloc=HARMLESS_LIBRARY) as server:
        with pytest.raises(RuntimeError, match="exited with 4 before serving"):
            server.wait_ready(timeout_s=30)
    with pytest.raises(FileNotFoundError, match="make vllm-venv"):
        VLLMServer(_settings(), "bench", venv=tmp_path / "nowhere")


def test_tessera_gets_the_same_engine_settings():
    args = tessera_pod_args(_settings(enable_prefix_caching=False, max_model_len=512, cpus="0,2-3"))
    assert args == ["--dtype", "bfloat16", "--max-num-seqs", "64", "--max-num-batched-tokens", "1024",
                    "--kv-cache-memory-bytes", str(2 << 30), "--cpu-threads", "3", "--max-model-len", "512",
                    "--no-prefix-caching"]
    assert core_count("0-1") == 2 and core_count("5") == 1


def test_auto_dtype_is_the_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path, "auto") == "bfloat16"
    assert checkpoint_dtype(tmp_path, "float32") == "float32"


def _figures(rps, goodput, p99_ttft, failed=0):
    return {"request_throughput": rps, "output_throughput": rps * 100, "request_goodput": goodput,
            "median_ttft_ms": p99_ttft / 2, "p99_ttft_ms": p99_ttft, "median_tpot_ms": 10.0, "p99_tpot_ms": 20.0,
            "failed": failed}


def test_a_rate_is_sustained_when_nothing_failed_and_the_throughput_kept_up():
    assert sustains(_figures(1.9, 1.0, 100), 2.0, 0.9)
    assert not sustains(_figures(1.7, 1.0, 100), 2.0, 0.9)
    assert not sustains(_figures(1.9, 1.0, 100, failed=1), 2.0, 0.9)
    assert not sustains(_figures(50.0, 1.0, 100), float("inf"), 0.9)
    # Judged against what the drawn arrivals offered: 1.7 req/s keeps up with a draw of 1.8.
    assert sustains({**_figures(1.7, 1.0, 100), "offered_rate": 1.8}, 2.0, 0.9)
    assert not sustains({**_figures(1.9, 1.0, 100), "offered_rate": 2.4}, 2.0, 0.9)


def test_rounds_give_medians_and_the_worst_failure_count():
    m = median_of_rounds([_figures(1.0, 0.5, 300), _figures(3.0, 0.9, 100, failed=2), _figures(2.0, 0.7, 200)])
    assert (m["request_throughput"], m["request_goodput"], m["p99_ttft_ms"], m["failed"]) == (2.0, 0.7, 200, 2)


def test_the_verdict_is_taken_at_the_highest_rate_vllm_sustains():
    rates = [1.0, 2.0, 4.0]
    by_side = {"tessera": [_figures(1.0, 1.0, 90), _figures(2.0, 1.8, 150), _figures(3.9, 3.0, 400)],
               "vllm": [_figures(1.0, 1.0, 100), _figures(1.9, 1.5, 160), _figures(3.0, 1.0, 900)]}
    found = verdict(rates, by_side, 0.9)
    assert found["request_rate"] == 2.0
    assert found["goodput_ratio"] == pytest.approx(1.8 / 1.5) and found["ttft_p99_no_worse"] is True
    by_side["vllm"] = [_figures(0.5, 0.1, 100)] * 3
    assert verdict(rates, by_side, 0.9) is None


def test_the_command_runs_both_servers_turn_about_and_reports_the_verdict(fake_vllm_server, tiny_llama, tmp_path,
                                                                          monkeypatch):
    """The whole command: Tessera's real engine pod and gateway on the tiny checkpoint, the stand-in
    in vLLM's place, two rates with two rounds each."""
    from tessera_tools.bench.peers import vllm_peer
    from tessera_tools.cli import main

    venv, record = fake_vllm_server
    monkeypatch.setenv("TESSERA_VLLM_VENV", str(venv))
    monkeypatch.setattr(vllm_peer, "TCMALLOC", HARMLESS_LIBRARY)
    out = tmp_path / "report.json"
    code = main(["bench", "serve", "--peer", "vllm", "--serve-model", str(tiny_llama), "--dtype", "float32",
                 "--max-model-len", "256", "--kv-cache-gib", "1", "--num-prompts", "6", "--max-prompt-len", "40",
                 "--max-output-len", "6", "--request-rates", "8,inf", "--rounds", "2", "--cooldown", "0",
                 "--goodput", "ttft:30000",
                 "--metric-percentiles", "50", "--disable-tqdm", "--logs", str(tmp_path / "logs"),
                 "--output-json", str(out)])
    assert code == 0, (tmp_path / "logs" / "pod.log").read_text()[-2000:]
    report = json.loads(out.read_text())
    assert report["rates"] == [8.0, "inf"] and report["peer"]["settings"]["dtype"] == "float32"
    assert report["cooldown_s"] == 0  # not the default 10
    for side in ("tessera", "vllm"):
        assert [len(rounds) for rounds in report["runs"][side]] == [2, 2]
        for rounds in report["runs"][side]:
            assert all((run["completed"], run["failed"]) == (6, 0) for run in rounds), rounds
            # Generous SLO: every request meets it; p99 is added for the verdict.
            assert all(run["request_goodput"] == pytest.approx(run["request_throughput"]) for run in rounds)
            assert all(run["p99_ttft_ms"] > 0 for run in rounds)
    found = report["verdict"]
    if found is not None:  # at most rate 8 (inf is never "sustained")
        assert found["request_rate"] == 8.0
        medians = report["medians"]
        assert found["goodput_ratio"] == pytest.approx(medians["tessera"][0]["request_goodput"]
                                                       / medians["vllm"][0]["request_goodput"])
    seen = json.loads(record.read_text())
    assert seen["argv"][seen["argv"].index("--model") + 1] == str(tiny_llama)
    assert all(_gone(pid) for pid in seen["pids"])


@pytest.mark.parametrize("argv, message", [
    (["--base-url", "http://127.0.0.1:1/v1"], "drop --base-url"),
    ([], "needs --serve-model"),
])
def test_peer_flags_that_cannot_work_are_refused(argv, message, capsys):
    from tessera_tools.cli import main

    assert main(["bench", "serve", "--peer", "vllm", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_peer_run_without_slos_is_refused(tiny_llama, capsys):
    from tessera_tools.cli import main

    assert main(["bench", "serve", "--peer", "vllm", "--serve-model", str(tiny_llama)]) == 2
    assert "--goodput" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--sustained-fraction", "1.5"], "--sustained-fraction 1.5"),
    (["--dtype", "float16"], "--dtype float16"),
])
def test_peer_values_that_cannot_work_are_refused(tiny_llama, argv, message, capsys):
    from tessera_tools.cli import main

    assert main(["bench", "serve", "--peer", "vllm", "--serve-model", str(tiny_llama), "--goodput", "ttft:100",
                 *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_negative_cooldown_is_refused_by_name(capsys):
    from tessera_tools.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--peer", "vllm", "--serve-model", "m", "--cooldown", "-1"])
    assert exit_info.value.code == 2 and "--cooldown" in capsys.readouterr().err
