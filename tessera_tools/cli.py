"""The ``tessera`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from engine_pod.entrypoints.cli_args import add_engine_args, engine_kwargs


def _cmd_make_model(args: argparse.Namespace) -> int:
    from tessera_tools.fixtures import make_model

    out = make_model(args.preset, args.out)
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine_pod import LLM, SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompts-file")
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        n=args.n,
    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera LLM inference platform")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a deterministic random-weight HF checkpoint")
    from tessera_tools.fixtures.make_model import PRESETS

    mm.add_argument("--preset", required=True, choices=sorted(PRESETS))
    mm.add_argument("out", help="output folder")
    mm.set_defaults(func=_cmd_make_model)

    gen = sub.add_parser("generate", help="generate offline with the engine")
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

    secret = sub.add_parser("internal-secret", help="print a new random internal secret (for TESSERA_INTERNAL_SECRET)")
    secret.set_defaults(func=_cmd_internal_secret)

    from engine_pod.server.main import add_parser as add_engine_parser
    from gateway.main import add_api_key_parser
    from gateway.main import add_parser as add_gateway_parser
    from tessera_tools.bench import add_bench_parser
    from tessera_tools.up import add_parser as add_up_parser
    from tessera_operator.main import add_parser as add_operator_parser

    add_engine_parser(sub)
    add_gateway_parser(sub)
    add_api_key_parser(sub)
    add_bench_parser(sub)
    add_operator_parser(sub)
    add_up_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tessera.child_process import die_with_parent

    die_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"tessera {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
