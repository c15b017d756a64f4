"""The runnable examples (examples/agent_loop.py, examples/batch_job.py) as a
user runs them: subprocesses of the repo's Python, against a real gateway and
the tiny model's engine pods, the API key in the environment (never argv).
They exit 0 with what they promise (schema-valid tool calls, every custom_id
back once) or 1 with one line on stderr, no traceback."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.gateway.conftest import KEYS

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
KEY = KEYS["alice"]


def _example_module(name: str):
    if str(EXAMPLES) not in sys.path:  # as `python examples/NAME.py` has it: its sibling example_client
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name: str, *args: str, key: str = KEY, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENAI_API_KEY": key}
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _one_line_failure(result: subprocess.CompletedProcess, name: str) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and KEY not in result.stderr + result.stdout
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{name}: ")
    return line


def test_agent_loop_calls_the_tool_with_schema_valid_arguments(platform):
    schema = _example_module("agent_loop").WEATHER_SCHEMA
    result = _run("agent_loop", "--base-url", platform.base_url + "/v1", "--rounds", "2", "--max-tokens", "64")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and KEY not in result.stdout
    calls = re.findall(r"^round (\d): call get_weather (\{.*?\}) -> (.*)$", result.stdout, re.M)
    assert [c[0] for c in calls] == ["1", "2"]
    for _, arguments, tool_result in calls:
        jsonschema.validate(json.loads(arguments), schema)
        assert json.loads(tool_result)["city"] == json.loads(arguments)["city"]  # the tool ran on them
    [answer] = [line for line in result.stdout.splitlines() if line.startswith("answer (tiny, finish_reason ")]
    assert isinstance(json.loads(answer.split("): ", 1)[1]), str)


def test_agent_loop_failures_are_one_line(platform):
    wrong_key = _one_line_failure(_run("agent_loop", "--base-url", platform.base_url + "/v1",
                                       key="sk-not-a-tenant"), "agent_loop")
    assert "401" in wrong_key and "sk-not-a-tenant" not in wrong_key
    cut_short = _one_line_failure(_run("agent_loop", "--base-url", platform.base_url + "/v1", "--max-tokens", "2"),
                                  "agent_loop")
    assert "--max-tokens 2" in cut_short
    unreachable = _one_line_failure(_run("agent_loop", "--base-url", "http://127.0.0.1:9/v1"), "agent_loop")
    assert "cannot reach the gateway at http://127.0.0.1:9/v1" in unreachable


def test_batch_job_gets_every_custom_id_back_once(batch_gateway):
    result = _run("batch_job", "--base-url", batch_gateway.base_url + "/v1", "--lines", "6", "--max-tokens", "4",
                  "--poll-interval", "0.2", "--timeout", "60")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and KEY not in result.stdout
    [summary] = [line for line in result.stdout.splitlines() if line.startswith("summary: ")]
    summary = json.loads(summary.removeprefix("summary: "))
    assert summary["status"] == "completed" and summary["every_custom_id_once"] is True
    assert (summary["requests"], summary["completed"], summary["failed"]) == (6, 6, 0)
    # Its files were deleted at the end; the batch stays.
    sdk = openai.OpenAI(base_url=batch_gateway.base_url + "/v1", api_key=KEY, max_retries=0)
    batch = sdk.batches.retrieve(summary["batch_id"])
    for file_id in (batch.input_file_id, batch.output_file_id):
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(file_id)


def test_batch_job_failures_are_one_line(batch_gateway, platform):
    late = _one_line_failure(_run("batch_job", "--base-url", batch_gateway.base_url + "/v1", "--lines", "50",
                                  "--timeout", "0.05", "--poll-interval", "0.05"), "batch_job")
    assert re.search(r"batch batch_\w+ still \w+ .*after the 0.05 s of --timeout; cancelled it", late), late
    no_batch_api = _one_line_failure(_run("batch_job", "--base-url", platform.base_url + "/v1"), "batch_job")
    assert "no Batch API" in no_batch_api
