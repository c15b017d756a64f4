"""`tessera bench latency`: one fixed batch timed over iterations, offline
and against a running gateway, with vLLM's figures; every bad input a clear
message and a non-zero exit."""

from __future__ import annotations

import json
import statistics

import pytest

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tessera.child_process import free_port
from tessera_tools.bench.latency import summarise
from tessera_tools.cli import main
from tests.gateway.conftest import MODEL_NAME, POD_ARGS, gateway_config

SMALL = ["--input-len", "8", "--output-len", "4", "--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "3",
         "--no-progress"]


def test_summary_has_vllms_figures():
    latencies = [0.4, 0.1, 0.2, 0.3]
    figures = summarise(latencies, batch_size=8, output_len=10)
    assert figures["avg_latency"] == pytest.approx(0.25) and figures["latencies"] == latencies
    assert list(figures["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert figures["percentiles"]["50"] == pytest.approx(statistics.median(latencies))
    assert figures["percentiles"]["10"] == pytest.approx(0.13)  # numpy's linear interpolation
    assert figures["output_tokens_per_second_at_median"] == pytest.approx(80 / 0.25)


def test_offline_batch_is_timed_over_its_iterations(tiny_llama, tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(tiny_llama), "--dtype", "float32", *SMALL,
                 "--max-num-seqs", "2", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["latencies"]) == 3 and all(t > 0 for t in report["latencies"])
    assert report["avg_latency"] == pytest.approx(statistics.fmean(report["latencies"]))
    # The engine flags reach the engine: two sequences at a time for a batch of three.
    assert report["target"]["engine"]["max_num_seqs"] == 2 and report["batch_size"] == 3


@pytest.fixture(scope="module")
def gateway(tiny_llama, tmp_path_factory):
    work = tmp_path_factory.mktemp("latency")
    with EnginePodProcess(tiny_llama, POD_ARGS, log_path=work / "pod.log") as pod:
        pod.wait_serving()
        with GatewayProcess(gateway_config(tiny_llama, [(pod, "mixed")]), work, log_path=work / "gw.log") as gw:
            gw.wait_ready(num_pods=1)
            yield gw


def test_against_a_running_gateway(gateway, tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--base-url", gateway.base_url + "/v1", "--model", MODEL_NAME,
                 "--vocab-size", "256", *SMALL, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["target"] == {"base_url": gateway.base_url + "/v1", "model": MODEL_NAME}
    assert len(report["latencies"]) == 3 and report["percentiles"]["99"] >= report["percentiles"]["10"] > 0


@pytest.mark.parametrize("argv, exit_status, message", [
    (["--model", "not-served"], 2, "not 'not-served' (--model)"),
    (["--model", MODEL_NAME, "--input-len", "300"], 1, "HTTP 400"),
])
def test_an_endpoint_refusing_is_a_clear_error(gateway, capsys, argv, exit_status, message):
    assert main(["bench", "latency", "--base-url", gateway.base_url + "/v1", "--vocab-size", "256", *SMALL[2:],
                 *argv]) == exit_status
    assert message in capsys.readouterr().err


def test_bad_inputs_exit_non_zero_with_the_reason(tiny_llama, capsys):
    model = ["--model", str(tiny_llama), "--dtype", "float32"]
    assert main(["bench", "latency", *model, "--input-len", "2000", "--output-len", "100"]) == 2
    assert "exceeds the engine's max_model_len" in capsys.readouterr().err
    assert main(["bench", "latency", *model, "--max-num-seqs", "0", *SMALL]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    assert main(["bench", "latency", "--base-url", f"http://127.0.0.1:{free_port()}/v1", "--model", "x"]) == 1
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency", *model, "--batch-size", "0"])
    assert exit_info.value.code == 2
