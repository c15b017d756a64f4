"""Every `tessera bench` parser refuses a count, length or duration that
would crash or hang the run: argparse's usage error (exit status 2) naming
the flag, before anything starts. Only the parsers run here."""

from __future__ import annotations

import argparse

import pytest

from tessera_tools.bench import add_bench_parser

# What each benchmark needs on its command line to parse at all.
REQUIRED = {"serve": ["--base-url", "http://127.0.0.1:1/v1"], "routing": [], "gateway": [], "fuzz": [],
            "kernels": []}

BAD = [
    ("cpu-kernels", "--context", "1"),
    ("cpu-kernels", "--context", "0"),
    ("cpu-kernels", "--repeats", "0"),
    ("cpu-kernels", "--batches", "1,0"),
    ("cpu-kernels", "--tokens", "x"),
    ("cpu-kernels", "--block-size", "-16"),
    ("throughput", "--num-requests", "0"),
    ("throughput", "--hf-batch-size", "0"),
    ("throughput", "--kv-cache-gib", "0"),
    ("throughput", "--max-num-seqs", "-1"),
    ("prefix-cache", "--rounds", "0"),
    ("prefix-cache", "--suffix-len", "-1"),
    ("prefix-cache", "--kv-cache-gib", "nan"),
    ("grpc", "--num-requests", "0"),
    ("grpc", "--max-output-len", "0"),
    ("kv-store", "--prompt-len", "16"),
    ("kv-store", "--repeats", "0"),
    ("kv-store", "--run-blocks", "0"),
    ("kv-store", "--read-rounds", "0"),
    ("kv-store", "--host-gib", "-2"),
    ("tp-overhead", "--steps", "0"),
    ("tp-overhead", "--rounds", "0"),
    ("tp-overhead", "--threads", "0"),
    ("tp-memory", "--tp", "0"),
    ("tp-memory", "--kv-blocks", "0"),
    ("guided", "--repeats", "0"),
    ("guided", "--threads", "-1"),
    ("guided", "--max-tokens", "0"),
    ("spec", "--k", "0"),
    ("spec", "--k", "2,x"),
    ("spec", "--rounds", "0"),
    ("spec", "--lookup-min", "0"),
    ("lora", "--num-adapters", "0"),
    ("lora", "--lora-rank", "-1"),
    ("lora", "--kv-cache-gib", "0"),
    ("routing", "--rate", "0"),
    ("routing", "--rounds", "0"),
    ("routing", "--system-prompts", "0"),
    ("routing", "--max-concurrency", "-1"),
    ("gateway", "--samples", "0"),
    ("gateway", "--concurrency", "1,0"),
    ("gateway", "--sweep-seconds", "0"),
    ("gateway", "--output-len", "0"),
    ("fuzz", "--concurrency", "0"),
    ("fuzz", "--timeout", "0"),
    ("fuzz", "--valid", "-1"),
    ("fuzz", "--pods", "0"),
    ("kernels", "--block-size", "0"),
    ("kernels", "--max-kv-gib", "0"),
    ("kernels", "--batch-sizes", "1,x"),
    ("serve", "--num-prompts", "0"),
    ("serve", "--max-concurrency", "0"),
    ("serve", "--burstiness", "0"),
    ("serve", "--request-timeout", "-1"),
    ("serve", "--num-warmups", "-1"),
    ("profile", "--holdout", "0"),
    ("profile", "--holdout", "1"),
    ("profile", "--holdout", "x"),
    ("profile", "--budgets", "0"),
    ("profile", "--batch-sizes", "4,x"),
    ("profile", "--prompt-lens", "-8"),
    ("profile", "--decode-len", "0"),
    ("profile", "--kv-cache-gib", "inf"),
    ("profile", "--threads", "-1"),
    ("fleet", "--pods", "0"),
    ("fleet", "--duration", "0"),
    ("fleet", "--pods-per-process", "0"),
    ("fleet", "--system-prompt-len", "5,1"),
    ("fleet", "--new-conversation-share", "2"),
    ("fleet", "--scenario", "chaos"),
    ("fleet", "--scenario-policy", "fastest"),
    ("fleet", "--scale-interval", "0"),
    ("fleet", "--scale-signal", "latency"),
    ("fleet", "--scale-target", "0"),
    ("fleet", "--min-replicas", "-1"),
    ("fleet", "--max-replicas", "0"),
    ("fleet", "--scale-up-window", "-1"),
    ("fleet", "--scale-down-window", "nan"),
    ("fleet", "--startup-delay", "-2"),
    ("pd", "--tp", "1,0"),
    ("pd", "--modes", "mixed,fast"),
    ("pd", "--modes", "redis,redis"),
    ("pd", "--rate", "0"),
    ("pd", "--rate", "nan"),
    ("pd", "--requests", "0"),
    ("pd", "--rounds", "0"),
    ("pd", "--prompt-tokens", "0"),
    ("pd", "--concurrency", "-1"),
    ("pd", "--goodput", "itl:50"),
    ("pd", "--goodput", "ttft:0"),
    ("pd", "--min-uncached-tokens", "-1"),
    ("pp", "--pipeline-parallel-size", "1"),
    ("pp", "--num-requests", "0"),
    ("pp", "--rounds", "0"),
    ("pp", "--kv-cache-gib", "nan"),
    ("latency", "--batch-size", "0"),
    ("latency", "--input-len", "0"),
    ("latency", "--num-iters", "0"),
    ("latency", "--num-iters-warmup", "-1"),
    ("latency", "--vocab-size", "5"),
    ("quality", "--max-tokens", "0"),
    ("quality", "--features", "base,fast"),
    ("quality", "--features", ","),
    ("quality", "--window", "1"),
    ("quality", "--parity-prompts", "0"),
]


def _parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="tessera")
    add_bench_parser(root.add_subparsers(dest="command"))
    return root


def _argv(bench: str, *extra: str) -> list[str]:
    return ["bench", bench, *REQUIRED.get(bench, ["--model", "unused"]), *extra]


@pytest.mark.parametrize("bench, flag, value", BAD, ids=[f"{b} {f} {v}" for b, f, v in BAD])
def test_bad_value_is_a_usage_error_naming_the_flag(bench, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(_argv(bench, f"{flag}={value}"))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and repr(value) in err, err


def test_every_benchmark_has_a_bad_value_case():
    kinds = _parser()._subparsers._group_actions[0].choices["bench"]._subparsers._group_actions[0].choices
    assert set(kinds) == {b for b, _, _ in BAD}


@pytest.mark.parametrize("argv, expected", [
    (_argv("cpu-kernels", "--context", "2", "--repeats", "1", "--batches", "3,5"),
     {"context": 2, "repeats": 1, "batches": [3, 5], "tokens": [1, 8, 32, 128, 512, 2048]}),
    (_argv("spec"), {"k": [2, 4, 6], "threads": 0}),
    (_argv("spec", "--k", "4"), {"k": [4]}),
    (_argv("gateway"), {"concurrency": [1, 2, 4, 8, 16, 32, 64], "warmup": 30, "output": "bench-results/gateway.json"}),
    (_argv("routing", "--max-concurrency", "0", "--suffix-len", "0"), {"max_concurrency": 0, "suffix_len": 0}),
    (_argv("kv-store", "--prompt-len", "64"), {"prompt_len": 64, "output": None}),
    (_argv("fuzz", "--valid", "0"), {"valid": 0, "malformed": 1000}),
    (_argv("serve", "--max-concurrency", "4"), {"max_concurrency": 4, "burstiness": 1.0, "num_warmups": 1}),
    (_argv("serve"), {"max_concurrency": None}),
    (_argv("pd"), {"tp": [1], "modes": ["mixed", "redis", "direct"], "prompt_tokens": 2016, "output_tokens": 32,
                   "rounds": 3, "concurrency": 1, "out": "bench-results/pd.json"}),
    (_argv("pd", "--tp", "1,2", "--modes", "direct,redis", "--rate", "inf", "--goodput", "ttft:500", "tpot:50"),
     {"tp": [1, 2], "modes": ["direct", "redis"], "rate": float("inf"), "goodput": [("ttft", 500.0), ("tpot", 50.0)]}),
    (_argv("profile"), {"holdout": 0.2, "budgets": [128, 1024], "output": None, "threads": 0}),
])
def test_good_values_and_defaults_parse(argv, expected):
    args = vars(_parser().parse_args(argv))
    assert {k: args[k] for k in expected} == expected
