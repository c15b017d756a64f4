"""The flags several benchmarks take, and the argparse types that refuse a
bad value up front (exit status 2, the flag named) instead of a crash or a
hang deep in a run."""

from __future__ import annotations

import argparse
from collections.abc import Callable

MODEL_HELP = "checkpoint folder (make bench-models builds models/bench)"
TINY_MODEL_HELP = ("checkpoint folder (default: the tiny preset, built into .cache; "
                   "make bench-models builds models/bench)")
DTYPE_HELP = "engine dtype (auto: the engine's choice for the device)"


# -- types ----------------------------------------------------------------------

def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def cpu_list(text: str) -> str:
    """An argparse type: cores as Linux lists them, e.g. "0-1" or "0,2-3" (ascending ranges)."""
    for part in text.split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and (not last.isdigit() or int(last) < int(first))):
            raise argparse.ArgumentTypeError(f"expected cores like 0-1 or 0,2-3, got {text!r}")
    return text


def core_count(cpus: str) -> int:
    """Cores in a Linux CPU list that `cpu_list` accepted ("0-1" -> 2, "0,2-3" -> 3)."""
    count = 0
    for part in cpus.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """"1,8,32" -> [1, 8, 32]; every value >= 1."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


# -- flags ----------------------------------------------------------------------

def add_model_args(p: argparse.ArgumentParser, *, default_tiny: bool = False, model_help: str | None = None) -> None:
    """--model (required, or the tiny preset by default) and --dtype."""
    if default_tiny:
        p.add_argument("--model", default=None, help=model_help or TINY_MODEL_HELP)
    else:
        p.add_argument("--model", required=True, help=model_help or MODEL_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)


def add_seed_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="workload seed")


def add_output_arg(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--output", default=default, help="write the results as JSON here")


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The in-process benchmarks' --model, --dtype, --seed and --output."""
    add_model_args(p)
    add_seed_arg(p)
    add_output_arg(p)


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=non_negative_int, default=0, help="torch threads (0: torch's default)")


def add_offline_peer_args(group) -> None:
    """--peer, --peer-cpus and --peer-log of the offline benchmarks run against vLLM's CPU
    build (throughput, prefix-cache; tessera_tools/bench/peers/vllm_peer.py)."""
    group.add_argument("--peer", choices=("vllm",), default=None,
                       help="vLLM's CPU build (make vllm-venv) on the same requests and settings, rounds alternated")
    group.add_argument("--peer-cpus", type=cpu_list, default="0-1",
                       help="the cores of vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)")
    group.add_argument("--peer-log", default=None, help="append vLLM's own output to this file")


def add_logs_arg(p: argparse.ArgumentParser) -> None:
    """For benchmarks that start pods and gateways (see common.work_dir)."""
    p.add_argument("--logs", default=None, help="keep pod and gateway logs under this folder")
