"""``tessera bench quality``: the question set's greedy accuracy, the engine against Hugging Face.

Every question of tessera_tools/fixtures/quality (facts and arithmetic asked through the chat
template, one-word completions as raw text) is answered greedily, stopping at the checkpoint's
EOS, by Hugging Face (`generate`, one question at a time) and by the engine under each feature
that must not change an output. A reply is right when an accepted answer appears as whole
words in its first line. What to read: each engine's accuracy next to HF's, and how many
replies are HF's token for token (a differing reply names the question).

Not yet here: the perplexity half, which needs the engine's prompt logprobs.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine_pod import LLM, SamplingParams
from tessera_tools.bench.common import markdown_table, write_report
from tessera_tools.bench.flags import add_model_args, add_output_arg, positive_int
from tessera_tools.fixtures.quality import is_correct, prompt_ids, questions

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

# Engine features that must leave every greedy reply as it is, and their settings.
FEATURES: dict[str, dict] = {
    "base": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-16": {"max_num_batched_tokens": 16},
    "chunked-64": {"max_num_batched_tokens": 64},
    "preemption": {"num_gpu_blocks": 24, "kv_cache_memory_bytes": None, "max_model_len": 256},
    "ngram-spec": {"speculative_config": SPEC},
}


def _hf_replies(model_path: str, dtype: torch.dtype, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    generation = GenerationConfig.from_pretrained(model_path)
    eos, pad = generation.eos_token_id, generation.pad_token_id
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
            out.append(seq[0, len(ids):].tolist())
    return out


def _strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def _engine_replies(model_path: str, dtype: str, settings: dict, prompts: list[list[int]], max_tokens: int):
    with LLM(model_path, dtype=dtype, **settings) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=max_tokens))
        return [o.outputs[0].token_ids for o in outputs], llm.get_tokenizer(), llm.processor.eos_token_ids


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    qs = questions()
    prompts = [prompt_ids(q, tokenizer) for q in qs]
    start = time.perf_counter()
    hf_dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    hf = _hf_replies(args.model, hf_dtype, prompts, args.max_tokens)
    report: dict = {"model": args.model, "dtype": args.dtype, "questions": len(qs),
                    "hf_seconds": time.perf_counter() - start, "features": {}}
    rows = []
    for feature in args.features:
        ours, tok, eos = _engine_replies(args.model, args.dtype, FEATURES[feature], prompts, args.max_tokens)
        hf_ids = [_strip_eos(r, eos) for r in hf]
        ours = [_strip_eos(r, eos) for r in ours]
        hf_right = [is_correct(q, tok.decode(r, skip_special_tokens=True)) for q, r in zip(qs, hf_ids)]
        our_right = [is_correct(q, tok.decode(r, skip_special_tokens=True)) for q, r in zip(qs, ours)]
        differing = [q.id for q, a, b in zip(qs, ours, hf_ids) if a != b]
        report["features"][feature] = {"accuracy": sum(our_right) / len(qs), "hf_accuracy": sum(hf_right) / len(qs),
                                       "identical_replies": len(qs) - len(differing), "differing": differing}
        rows.append([feature, f"{sum(our_right)}/{len(qs)}", f"{sum(hf_right)}/{len(qs)}",
                     f"{len(qs) - len(differing)}/{len(qs)}", ", ".join(differing[:5]) or "-"])
    print(markdown_table(["engine feature", "Tessera right", "HF right", "replies identical to HF", "differing"],
                         rows))
    write_report(report, args.output)
    return 0


def _features(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(FEATURES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown or no features {unknown}; choose from {sorted(FEATURES)}")
    return names


def add_parser(kinds) -> None:
    p = kinds.add_parser("quality", help="the question set's greedy accuracy, the engine against Hugging Face")
    add_model_args(p)
    p.add_argument("--features", type=_features, default="base",
                   help=f"comma-separated engine features to run (default base; any of {', '.join(FEATURES)})")
    p.add_argument("--max-tokens", type=positive_int, default=16, help="tokens per reply at most")
    add_output_arg(p)
    p.set_defaults(bench_func=main)
