"""The ``tessera`` command line, run as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_pod import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository


def _tessera(*args: str, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tessera_tools.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )


@pytest.fixture(scope="module")
def made_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    proc = _tessera("make-model", "--preset", "tiny", str(out))
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_make_model(made_model, tiny_llama):
    out, proc = made_model
    assert str(out) in proc.stdout
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file()
    # Deterministic: the same bytes as the session's checkpoint of the preset.
    for f in tiny_llama.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_generate_json(made_model):
    out, _ = made_model
    proc = _tessera("generate", "--model", str(out), "--prompt", "hi", "--prompt", "Once upon a time",
                    "--max-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["prompt"] for r in records] == ["hi", "Once upon a time"]
    for r in records:
        assert r["index"] == 0
        assert len(r["token_ids"]) == 4
        assert r["finish_reason"] == "length"
        assert isinstance(r["text"], str)
        assert isinstance(r["num_cached_tokens"], int)
    assert "steps=" in proc.stderr
    # The CLI's greedy default agrees with the library (float32 on CPU by default).
    llm = LLM(str(out), dtype="float32")
    expected = llm.generate(["hi", "Once upon a time"], SamplingParams(temperature=0.0, max_tokens=4))
    assert [r["token_ids"] for r in records] == [o.outputs[0].token_ids for o in expected]
    assert [r["text"] for r in records] == [o.outputs[0].text for o in expected]


def test_generate_n_and_seed(made_model):
    out, _ = made_model
    args = ["generate", "--model", str(out), "--prompt", "hi", "--max-tokens", "3", "--json",
            "--temperature", "1.0", "--seed", "5", "--n", "2"]
    first = _tessera(*args)
    assert first.returncode == 0, first.stderr
    records = [json.loads(line) for line in first.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1]
    assert _tessera(*args).stdout == first.stdout  # seeded: reproducible across processes


def test_bad_max_tokens_exits_2_naming_the_field(made_model):
    out, _ = made_model
    proc = _tessera("generate", "--model", str(out), "--prompt", "hi", "--max-tokens", "0", "--json")
    assert proc.returncode == 2
    assert "max_tokens" in proc.stderr
    assert proc.stdout == ""


def test_bad_temperature_exits_2(made_model):
    out, _ = made_model
    proc = _tessera("generate", "--model", str(out), "--prompt", "hi", "--temperature", "-1")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr


def test_missing_model_folder_exits_2(tmp_path):
    proc = _tessera("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "error" in proc.stderr and "config.json" in proc.stderr


def test_engine_refuses_triton_on_cpu_without_the_interpreter(made_model):
    out, _ = made_model
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = _tessera("engine", "--model", str(out), "--device", "cpu", "--attention-backend", "triton",
                    "--grpc-port", "0", "--cpu-threads", "1", env=env)
    assert proc.returncode == 2
    assert "attention_backend='triton' cannot run here" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr


def test_argparse_errors_exit_2():
    proc = _tessera("generate", "--model", "x", "--max-tokens", "many")
    assert proc.returncode == 2
    assert "--max-tokens" in proc.stderr


def test_api_key_prints_a_key_and_the_entry_that_authenticates_it():
    import yaml

    from gateway.tenants import TenantRegistry
    from tessera.internal_secret import InternalSecret

    proc = _tessera("api-key", "--tenant", "acme")
    assert proc.returncode == 0, proc.stderr
    key = proc.stdout.splitlines()[0].rsplit(" ", 1)[1]
    registry = TenantRegistry.from_dict(yaml.safe_load(proc.stdout), InternalSecret.generate())
    assert registry.authenticate(f"Bearer {key}").name == "acme"


def test_gateway_refuses_a_bad_config_with_a_clear_message(tmp_path):
    (tmp_path / "gateway.yaml").write_text("model: {name: m, path: /nowhere}\npods: {static: [{address: nohost}]}\n")
    proc = _tessera("gateway", "--config", str(tmp_path / "gateway.yaml"))
    assert proc.returncode == 2
    assert "pods.static: address 'nohost' is not host:port" in proc.stderr


def _listed_help(parser) -> dict[str, str]:
    import argparse

    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {choice.dest: choice.help for choice in subcommands._choices_actions}


def test_help_lists_every_subcommand_without_importing_it():
    """`tessera --help` imports no subcommand's module (they may take seconds:
    torch, kubernetes), yet lists each with its one-line help."""
    code = (
        "import sys\nfrom tessera_tools import cli\n"
        "text = ' '.join(cli.build_parser([]).format_help().split())\n"
        "modules = {spec.split(':')[0] for _, spec in cli._COMMANDS.values()} - {'tessera_tools.cli'}\n"
        "heavy = ('torch', 'kopf', 'kubernetes', 'fastapi', 'grpc', 'engine_pod', 'gateway.main')\n"
        "print(sorted(m for m in (*modules, *heavy) if m in sys.modules))\n"
        "print(all(f'{name} {help_text}' in text for name, (help_text, _) in cli._COMMANDS.items()))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[]", "True"], proc.stdout


def test_each_subcommands_listed_help_is_its_own():
    """The lazy listing's help is what each subcommand's module registers."""
    from tessera_tools import cli

    assert _listed_help(cli.build_parser()) == {name: help_text for name, (help_text, _) in cli._COMMANDS.items()}
    assert _listed_help(cli.build_parser([])) == _listed_help(cli.build_parser())


@pytest.mark.parametrize("argv,command", [
    (["gateway", "--config", "x"], "gateway"), (["--log-level", "INFO", "up", "-f", "a"], "up"),
    (["--log-level=DEBUG", "api-key", "--tenant", "t"], "api-key"), (["--log", "INFO", "bench"], "bench"),
    (["--help"], None), ([], None),
])
def test_the_subcommand_is_found_in_the_arguments(argv, command):
    from tessera_tools import cli

    assert cli._command_in(argv) == command


def test_subcommand_help_loads_only_that_subcommand():
    proc = _tessera("gateway", "--help")
    assert proc.returncode == 0 and "--config CONFIG" in proc.stdout and "--drain-timeout" in proc.stdout
    proc = _tessera("nosuch")
    assert proc.returncode == 2 and "invalid choice: 'nosuch'" in proc.stderr


def _without_torch(command: list[str]) -> subprocess.CompletedProcess:
    """The CLI with torch made unimportable, the way an absent one is."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from tessera_tools.cli import main\n"
            f"sys.exit(main({command!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("command", [["engine", "--no-internal-auth", "--metrics-port", "0", "--grpc-port", "0"],
                                     ["generate", "--prompt", "x"]])
def test_an_engine_command_without_torch_names_the_extra(command, tiny_llama):
    """In a control-plane install (no torch) a command that runs the model
    exits 2 naming the extra, not with a traceback."""
    proc = _without_torch([command[0], "--model", str(tiny_llama), *command[1:]])
    assert proc.returncode == 2, proc.stderr
    assert "needs the engine extra (pip install 'tessera[engine]'): torch is not installed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_engine_command_itself_needs_no_torch():
    """Its flags, and simulated pods (engine_pod/sim), need no torch: only running a model does."""
    proc = _without_torch(["engine", "--help"])
    assert proc.returncode == 0 and "--simulate PROFILE" in proc.stdout, proc.stderr
