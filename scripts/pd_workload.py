"""Write the JSONL workload of the mixed-vs-disaggregated benchmark
(docs/benchmarks.md): long prompts with short outputs mixed with short
prompts with long outputs, shuffled, seeded.

    .venv/bin/python scripts/pd_workload.py --tokenizer models/tiny --out bench-results/pd.jsonl
"""

from __future__ import annotations

import argparse
import json
import random

from tessera_tools.fixtures.tokenizer import corpus_lines
from tessera.text import encode_prompt, load_tokenizer


def prompt_of(tokenizer, words: list[str], rng: random.Random, num_tokens: int) -> str:
    """Random corpus words, cut to exactly `num_tokens` tokens."""
    text = " ".join(rng.choice(words) for _ in range(num_tokens * 2))
    ids = encode_prompt(tokenizer, text, add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-long-prompts", type=int, default=40, help="1,024-token prompts, 8 output tokens")
    p.add_argument("--num-long-outputs", type=int, default=80, help="32-token prompts, 128 output tokens")
    args = p.parse_args()
    rng = random.Random(args.seed)
    tokenizer = load_tokenizer(args.tokenizer)
    words = [w for line in corpus_lines() for w in line.split()]
    rows = [{"prompt": prompt_of(tokenizer, words, rng, 1024), "output_len": 8} for _ in range(args.num_long_prompts)]
    rows += [{"prompt": prompt_of(tokenizer, words, rng, 32), "output_len": 128} for _ in range(args.num_long_outputs)]
    rng.shuffle(rows)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
