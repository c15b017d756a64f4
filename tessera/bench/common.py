"""Flags every benchmark takes."""

from __future__ import annotations

import argparse


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint folder (make bench-models builds models/bench)")
    p.add_argument("--dtype", default="auto", help="engine dtype (auto: the engine's choice for the device)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--output", help="write the results as JSON here")
