"""`tessera bench serve --background-batch`: interactive requests alone and
with a batch job running through the Batch API, on a platform the command
starts (an engine pod yielding to interactive work, a gateway with batch on)."""

from __future__ import annotations

import json

import pytest
import yaml

from tessera_tools.bench.serve.background import compare
from tessera_tools.bench.serve.background_batch import BatchFigures, batch_input
from tessera_tools.bench.serve.client import Target
from tessera_tools.bench.serve.dataset import ServeRequest


def test_the_command_runs_both_modes_turn_about_and_reports_the_batch(tiny_llama, tmp_path):
    from tessera_tools.cli import main

    out, logs = tmp_path / "bg.json", tmp_path / "logs"
    argv = ["bench", "serve", "--serve-model", str(tiny_llama), "--background-batch", "40",
            "--background-max-tokens", "8", "--background-warmup", "0.5", "--background-concurrency", "4",
            "--num-prompts", "6", "--max-prompt-len", "48", "--max-output-len", "6", "--request-rate", "6",
            "--rounds", "2", "--cooldown", "0", "--max-model-len", "256", "--kv-cache-gib", "1",
            "--disable-tqdm", "--output-json", str(out), "--logs", str(logs)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["background_batch_lines"] == 40
    (result,) = report["results"]
    for mode in ("alone", "with-batch"):
        assert len(result["runs"][mode]) == 2
        assert all((run["completed"], run["failed"]) == (6, 0) for run in result["runs"][mode])
    assert len(result["batches"]) == 2
    for batch in result["batches"]:
        assert batch["status"] in ("cancelled", "completed")
        assert batch["lines_completed"] >= 1 and batch["lines_failed"] == 0
        # Each completed line generated its max_tokens (ignore_eos), counted from the output file.
        assert batch["output_tokens"] == 8 * batch["lines_completed"]
        assert batch["output_tokens_per_s"] > 0
    assert result["p99_ttft_ratio"] == pytest.approx(result["medians"]["with-batch"]["p99_ttft_ms"]
                                                     / result["medians"]["alone"]["p99_ttft_ms"])
    # The pod was started yielding to interactive work, at the built-in batch class's priority,
    # which the gateway's batch lines run at.
    engine = report["engine_args"]
    assert engine[engine.index("--scheduling-policy") + 1] == "priority"
    assert engine[engine.index("--background-priority") + 1] == "20"
    gateway_config = yaml.safe_load((logs / "gateway.yaml").read_text())
    assert gateway_config["batch"]["priority_class"] == report["batch_priority_class"] == "batch"


@pytest.mark.parametrize("argv, message", [
    ([], "needs --base-url"),
    (["--base-url", "http://127.0.0.1:1/v1", "--serve-model", "models/tiny"], "not both"),
    (["--peer", "vllm", "--serve-model", "models/tiny"], "drop --peer"),
])
def test_background_flags_that_cannot_work_are_refused(argv, message, capsys):
    from tessera_tools.cli import main

    assert main(["bench", "serve", "--background-batch", "10", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_batch_input_is_the_interactive_shape_without_streaming():
    target = Target("http://x/v1", "chat", "m", ignore_eos=True)
    lines = [json.loads(line) for line in batch_input(target, [ServeRequest(5, prompt="hi")], 7).splitlines()]
    assert lines == [{"custom_id": "bg-0", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "m", "temperature": 0.0, "messages": [{"role": "user", "content": "hi"}],
                               "max_completion_tokens": 7, "ignore_eos": True}}]


def test_the_comparison_is_of_medians_over_rounds():
    def run(p99, median=1.0):
        return {"median_ttft_ms": median, "p99_ttft_ms": p99, "median_itl_ms": 1.0, "p99_itl_ms": 2.0,
                "output_throughput": 10.0, "failed": 0}

    batches = [BatchFigures("cancelled", 10, 0, 100, 50, 5.0).as_json(),
               BatchFigures("cancelled", 30, 0, 300, 150, 5.0).as_json()]
    found = compare({"alone": [run(100.0), run(120.0), run(110.0)],
                     "with-batch": [run(121.0), run(400.0), run(99.0)]}, batches)
    assert found["p99_ttft_ratio"] == pytest.approx(121.0 / 110.0)
    assert found["batch_output_tokens_per_s"] == pytest.approx(20.0)  # median of 10 and 30 tok/s
    assert found["batch_lines_completed"] == 20
