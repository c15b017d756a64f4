"""The requests a serving benchmark sends: the seeded ShareGPT-like workload
as text, or a JSONL file, optionally behind shared-prefix groups.

Prompts travel as text (any OpenAI-compatible server tokenizes with its own
tokenizer), so the synthetic texts are decoded from the benchmark tokenizer's
ids and re-encoded until their length in tokens is what was drawn.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from tessera_tools.bench.workload import _text_tokens, sharegpt_like
from tessera.text import encode_prompt


@dataclass(frozen=True)
class ServeRequest:
    """One request: a prompt (completions) or chat messages, and how many
    tokens to generate."""

    output_len: int
    prompt: str | None = None
    messages: list[dict] | None = None
    # Prompt tokens by the benchmark's tokenizer, without special tokens or a
    # chat template (None: not known). The server's usage, when it sends one,
    # is what the metrics count.
    prompt_len: int | None = None


def _count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(encode_prompt(tokenizer, text, add_special_tokens=False))


def _text_of_length(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> tuple[str, int]:
    """Text that encodes to (about) len(token_ids) tokens, and its exact length.
    Decoding a slice of ids and encoding it again is almost always exact; when
    the re-encoding comes out longer, cut it and try again."""
    target = len(token_ids)
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    for _ in range(4):
        ids = encode_prompt(tokenizer, text, add_special_tokens=False)
        if len(ids) <= target:
            return text, len(ids)
        text = tokenizer.decode(ids[:target], skip_special_tokens=True)
    return text, _count_tokens(tokenizer, text)


def synthetic_requests(tokenizer: PreTrainedTokenizerBase, num_requests: int, max_prompt_len: int,
                       max_output_len: int, seed: int) -> list[ServeRequest]:
    """The seeded ShareGPT-like workload (tessera_tools.bench.workload), as text prompts."""
    requests = []
    for r in sharegpt_like(tokenizer, num_requests, max_prompt_len, max_output_len, seed):
        text, length = _text_of_length(tokenizer, r.prompt_token_ids)
        requests.append(ServeRequest(output_len=r.output_len, prompt=text, prompt_len=length))
    return requests


# -- JSONL ----------------------------------------------------------------------
def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _valid_messages(messages) -> bool:
    return (isinstance(messages, list) and len(messages) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages))


def _parse_line(line: str, where: str, tokenizer: PreTrainedTokenizerBase | None) -> ServeRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if ("prompt" in record) == ("messages" in record):
        raise ValueError(f"{where}: give exactly one of \"prompt\" (text) or \"messages\" (chat)")
    if not _positive_int(record.get("output_len")):
        raise ValueError(f"{where}: \"output_len\" must be a positive integer, got {record.get('output_len')!r}")
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: \"prompt\" must be a non-empty string")
        length = _count_tokens(tokenizer, prompt) if tokenizer is not None else None
        return ServeRequest(output_len=record["output_len"], prompt=prompt, prompt_len=length)
    if not _valid_messages(record["messages"]):
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of objects with \"role\" and \"content\"")
    return ServeRequest(output_len=record["output_len"], messages=record["messages"])


def load_jsonl(path: str | Path, num_requests: int,
               tokenizer: PreTrainedTokenizerBase | None = None) -> list[ServeRequest]:
    """One request per non-blank line: {"prompt": TEXT, "output_len": N} or
    {"messages": [...], "output_len": N}. The first `num_requests` lines are
    used; a shorter file is cycled through. A bad line raises a ValueError
    that names it."""
    parsed = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                parsed.append(_parse_line(line, f"{path} line {number}", tokenizer))
    if not parsed:
        raise ValueError(f"{path}: no requests (the file is empty)")
    return list(itertools.islice(itertools.cycle(parsed), num_requests))


# -- shared prefixes ------------------------------------------------------------------
def _prepend_to_messages(prefix: str, messages: list[dict]) -> list[dict]:
    first = dict(messages[0])
    content = first.get("content")
    if isinstance(content, list):  # content parts: the prefix becomes the first text part
        first["content"] = [{"type": "text", "text": prefix}, *content]
    else:
        first["content"] = prefix + (content or "")
    return [first, *messages[1:]]


def with_prefix_groups(requests: list[ServeRequest], tokenizer: PreTrainedTokenizerBase, num_groups: int,
                       prefix_len: int, seed: int) -> list[ServeRequest]:
    """Each request starts with one of `num_groups` shared prefixes of
    `prefix_len` tokens (a system prompt or a document several users ask
    about), chosen by a seeded draw: what prefix caching and prefix-aware
    routing are for."""
    if num_groups < 1 or prefix_len < 1:
        raise ValueError("--prefix-groups and --prefix-len must both be >= 1")
    rng = random.Random(seed)
    corpus = _text_tokens(tokenizer)
    prefixes = []
    for _ in range(num_groups):
        start = rng.randrange(0, len(corpus) - prefix_len)
        text, length = _text_of_length(tokenizer, corpus[start : start + prefix_len])
        # A line break ends the prefix, so the first tokens of what follows
        # do not merge with its last one: every group member shares it whole.
        prefixes.append((text + "\n", length + 1))
    out = []
    for r in requests:
        prefix, length = prefixes[rng.randrange(num_groups)]
        if r.messages is not None:
            out.append(replace(r, messages=_prepend_to_messages(prefix, r.messages)))
        else:
            out.append(replace(r, prompt=prefix + r.prompt,
                               prompt_len=None if r.prompt_len is None else r.prompt_len + length))
    return out


def check_endpoint(requests: list[ServeRequest], endpoint: str) -> None:
    """Chat messages need the chat endpoint (a text prompt goes to either:
    as one user message on chat)."""
    if endpoint == "completions" and any(r.messages is not None for r in requests):
        raise ValueError("the dataset has chat \"messages\": use --endpoint chat")
