"""``tessera bench quality``: perplexity and the question set's greedy accuracy, the engine
against Hugging Face.

Perplexity: the first `--ppl-tokens` tokens of the shipped text (Alice's Adventures in
Wonderland), cut into windows of `--window` tokens that each start afresh; every token after a
window's first is scored, through the engine's prompt logprobs and through HF's forward on the
same window; perplexity is exp of the mean negative logprob.

Greedy parity: `--parity-prompts` prompts (tessera_tools/fixtures/quality.parity_prompts) x
`--parity-tokens` tokens, each engine token checked against HF's choice given the same prefix
(tessera_tools/bench/hf_parity.py); where one parts, both top-2 margins are reported (under
speculative decoding the engine reports no logprobs, so only HF's).

Accuracy: every question of tessera_tools/fixtures/quality (facts and arithmetic asked through the chat
template, one-word completions as raw text) is answered greedily, stopping at the checkpoint's
EOS, by Hugging Face (`generate`, one question at a time) and by the engine under each feature
that must not change an output. A reply is right when an accepted answer appears as whole
words in its first line. What to read: each engine's accuracy next to HF's, and how many
replies are HF's token for token (a differing reply names the question).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from engine_pod import LLM, SamplingParams
from tessera_tools.bench.common import markdown_table, write_report
from tessera_tools.bench.flags import add_model_args, add_output_arg, int_at_least, positive_int
from tessera_tools.bench.hf_parity import greedy_divergences
from tessera_tools.fixtures.quality import is_correct, parity_prompts, prompt_ids, questions, text

TEXT_NAME = "Alice's Adventures in Wonderland"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

# Engine features that must leave every greedy reply as it is, and their settings.
FEATURES: dict[str, dict] = {
    "base": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-16": {"max_num_batched_tokens": 16},
    "chunked-64": {"max_num_batched_tokens": 64},
    # Room for one perplexity window (1024 tokens) and little else: the question set preempts.
    "preemption": {"num_gpu_blocks": 80, "kv_cache_memory_bytes": None, "max_model_len": 1040},
    "ngram-spec": {"speculative_config": SPEC},
}


def _windows(tokenizer, num_tokens: int, window: int) -> list[list[int]]:
    ids = tokenizer.encode(text(), add_special_tokens=False)[:num_tokens]
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]


def _hf_nll(model, windows: list[list[int]]) -> tuple[float, int]:
    """Summed negative logprob of every scored token, and how many."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
            total -= logprobs.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
            count += len(ids) - 1
    return total, count


def _engine_nll(llm: LLM, windows: list[list[int]]) -> tuple[float, int]:
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    total, count = 0.0, 0
    for ids, out in zip(windows, outputs):
        for token, step in zip(ids[1:], out.prompt_logprobs[1:]):
            total -= step[token].logprob
            count += 1
    return total, count


def _hf_replies(model, model_path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import GenerationConfig

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


def _engine_run(model_path: str, dtype: str, settings: dict, prompts: list[list[int]], max_tokens: int,
                windows: list[list[int]], parity: tuple[list[list[int]], int]):
    """The engine's replies, its tokenizer and EOS ids, its (nll, count) on the windows, and its
    greedy outputs on the parity prompts."""
    with LLM(model_path, dtype=dtype, **settings) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=max_tokens))
        nll = _engine_nll(llm, windows)
        margins = None if "speculative_config" in settings else 2  # a request with logprobs is never drafted for
        greedy = llm.generate([{"prompt_token_ids": p} for p in parity[0]],
                              SamplingParams(temperature=0, max_tokens=parity[1], ignore_eos=True, logprobs=margins))
        replies = [o.outputs[0].token_ids for o in outputs]
        return replies, llm.get_tokenizer(), llm.processor.eos_token_ids, nll, greedy


def main(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    qs = questions()
    prompts = [prompt_ids(q, tokenizer) for q in qs]
    windows = _windows(tokenizer, args.ppl_tokens, args.window)
    parity = parity_prompts(tokenizer, args.parity_prompts), args.parity_tokens
    start = time.perf_counter()
    hf_dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=hf_dtype).eval()
    hf = _hf_replies(model, args.model, prompts, args.max_tokens)
    hf_nll, scored = _hf_nll(model, windows)
    hf_ppl = math.exp(hf_nll / scored)
    report: dict = {"model": args.model, "dtype": args.dtype, "questions": len(qs), "scored_tokens": scored,
                    "hf_perplexity": hf_ppl, "hf_seconds": time.perf_counter() - start, "features": {}}
    print(f"perplexity: {scored} tokens of {TEXT_NAME} in windows of {args.window}; HF {hf_ppl:.4f}")
    rows = []
    for feature in args.features:
        ours, tok, eos, (nll, count), greedy = _engine_run(args.model, args.dtype, FEATURES[feature], prompts,
                                                           args.max_tokens, windows, parity)
        parted = greedy_divergences(model, parity[0], greedy)
        for d in parted:
            engine_margin = "-" if d.engine_margin is None else f"{d.engine_margin:.4f}"
            print(f"  {feature}: prompt {d.prompt} token {d.position}: engine {d.engine_token} vs HF {d.hf_token}, "
                  f"margins HF {d.hf_margin:.4f} engine {engine_margin}")
        if count != scored:
            raise RuntimeError(f"{feature}: the engine scored {count} tokens, HF {scored}")
        ppl = math.exp(nll / count)
        hf_ids = [_strip_eos(r, eos) for r in hf]
        ours = [_strip_eos(r, eos) for r in ours]
        hf_right = [is_correct(q, tok.decode(r, skip_special_tokens=True)) for q, r in zip(qs, hf_ids)]
        our_right = [is_correct(q, tok.decode(r, skip_special_tokens=True)) for q, r in zip(qs, ours)]
        differing = [q.id for q, a, b in zip(qs, ours, hf_ids) if a != b]
        report["features"][feature] = {"perplexity": ppl, "perplexity_vs_hf": ppl / hf_ppl - 1,
                                       "parity_divergences": [vars(d) for d in parted],
                                       "accuracy": sum(our_right) / len(qs), "hf_accuracy": sum(hf_right) / len(qs),
                                       "identical_replies": len(qs) - len(differing), "differing": differing}
        rows.append([feature, f"{ppl:.4f}", f"{hf_ppl:.4f}", f"{100 * (ppl / hf_ppl - 1):+.4f}%",
                     f"{len(parity[0]) - len(parted)}/{len(parity[0])}",
                     f"{sum(our_right)}/{len(qs)}", f"{sum(hf_right)}/{len(qs)}",
                     f"{len(qs) - len(differing)}/{len(qs)}", ", ".join(differing[:5]) or "-"])
        print(" | ".join(rows[-1]), flush=True)  # as each feature ends: a long run's figures survive a cut
    print(markdown_table(["engine feature", "Tessera ppl", "HF ppl", "vs HF", "greedy = HF", "Tessera right",
                          "HF right", "replies identical to HF", "differing"], rows))
    write_report(report, args.output)
    return 0


def _features(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(FEATURES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown or no features {unknown}; choose from {sorted(FEATURES)}")
    return names


def add_parser(kinds) -> None:
    p = kinds.add_parser("quality", help="perplexity and the question set's accuracy, the engine against Hugging Face")
    add_model_args(p)
    p.add_argument("--features", type=_features, default="base",
                   help=f"comma-separated engine features to run (default base; any of {', '.join(FEATURES)})")
    p.add_argument("--max-tokens", type=positive_int, default=16, help="tokens per reply at most")
    p.add_argument("--ppl-tokens", type=int_at_least(2048), default=20480,
                   help="tokens of the text scored for perplexity (default 20480; the text has ~37,800)")
    p.add_argument("--window", type=int_at_least(2), default=1024, help="tokens per perplexity window")
    p.add_argument("--parity-prompts", type=positive_int, default=64, help="prompts of the greedy parity check")
    p.add_argument("--parity-tokens", type=positive_int, default=64, help="greedy tokens per parity prompt")
    add_output_arg(p)
    p.set_defaults(bench_func=main)
