"""Sampling end to end: seeds are batch-invariant, filters restrict the
support, penalties act, n>1 samples share the prompt's blocks, and every stop
condition ends a request the way vLLM does.

Expectations come from a first (greedy or seeded) run of the same engine, or
from the definitions; no token lists are hard-coded.
"""

from __future__ import annotations

import math
import random

import pytest

from engine_pod import LLM, SamplingParams

ENGINE_KW = dict(dtype="float64", max_model_len=512, kv_cache_memory_bytes=64 << 20)
EOS_IDS = {1, 3}  # <|end_of_text|> (tokenizer EOS), <|im_end|> (generation_config)
BLOCK_SIZE = 16

# Prompts whose greedy continuation on the 'tiny' checkpoint starts with EOS,
# found once by a greedy search over random 2- and 4-token prompts. The tests
# check this premise first, so a changed fixture fails loudly, not silently.
EOS_PROMPTS = [[4476, 5079], [1192, 710, 1654, 4192]]


def _random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 6000) for _ in range(n)] for n in lengths]


def _tp(ids: list[int]) -> dict:
    return {"prompt_token_ids": ids}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), **ENGINE_KW)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def _greedy(llm, prompt, max_tokens, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))[0].outputs[0]


# -- seeds -----------------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, seed=123, max_tokens=32)


def test_seed_gives_same_tokens_whatever_else_is_in_the_batch(llm, tiny_llama):
    target, *others = _random_prompts(1, [37, 5, 80, 12, 150, 21])
    alone = llm.generate(_tp(target), SEEDED)[0].outputs[0].token_ids
    assert len(alone) == 32

    batch_prompts = [others[0], others[1], target, others[2], others[3], others[4]]
    batch_params = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=20),
        SamplingParams(temperature=0.8, max_tokens=40, top_k=50, top_p=0.9),   # unseeded
        SEEDED,
        SamplingParams(temperature=0.0, max_tokens=10),                         # greedy
        SamplingParams(temperature=1.0, seed=123, max_tokens=32, min_p=0.1),   # same seed, other prompt
        SamplingParams(temperature=1.2, max_tokens=25, repetition_penalty=1.3, presence_penalty=0.5, logprobs=3),
    ]
    batch = llm.generate([_tp(p) for p in batch_prompts], batch_params)
    assert batch[2].outputs[0].token_ids == alone
    # The same seed on another prompt gives other tokens.
    assert batch[4].outputs[0].token_ids != alone

    # And again in a fresh engine that chunks prefills and batches differently.
    other = LLM(str(tiny_llama), **{**ENGINE_KW, "max_num_batched_tokens": 16, "block_size": 8})
    again = other.generate([_tp(p) for p in batch_prompts], batch_params)
    assert again[2].outputs[0].token_ids == alone


def test_seed_is_reproducible_and_other_seeds_differ(llm):
    (prompt,) = _random_prompts(2, [20])
    first = llm.generate(_tp(prompt), SEEDED)[0].outputs[0].token_ids
    second = llm.generate(_tp(prompt), SEEDED)[0].outputs[0].token_ids
    assert first == second
    other_seed = SamplingParams(temperature=1.0, seed=124, max_tokens=32)
    assert llm.generate(_tp(prompt), other_seed)[0].outputs[0].token_ids != first
    # Unseeded sampling is random: two runs differ (32 tokens from a flat distribution).
    unseeded = SamplingParams(temperature=1.0, max_tokens=32)
    a = llm.generate(_tp(prompt), unseeded)[0].outputs[0].token_ids
    b = llm.generate(_tp(prompt), unseeded)[0].outputs[0].token_ids
    assert a != b


# -- support restriction -----------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs",
    [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6), dict(temperature=1e-6)],
    ids=["top_k=1", "min_p=1", "top_p=1e-6", "temperature=1e-6"],
)
def test_degenerate_filters_are_greedy(llm, kwargs):
    prompts = _random_prompts(3, [9, 33])
    greedy = [o.outputs[0].token_ids for o in
              llm.generate([_tp(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=12))]
    params = SamplingParams(**{"temperature": 1.0, "seed": 5, "max_tokens": 12, **kwargs})
    got = [o.outputs[0].token_ids for o in llm.generate([_tp(p) for p in prompts], params)]
    assert got == greedy


def test_top_k_samples_only_among_the_k_most_likely(llm):
    (prompt,) = _random_prompts(4, [15])
    k = 3
    out = llm.generate(_tp(prompt), SamplingParams(temperature=1.0, seed=9, top_k=k, max_tokens=24, logprobs=k))
    completion = out[0].outputs[0]
    for token, step in zip(completion.token_ids, completion.logprobs):
        # Logprobs are the raw distribution at temperature 1: the rank is the top-k rank.
        assert step[token].rank <= k
    # Not degenerate: something other than the top token was sampled.
    assert any(step[t].rank > 1 for t, step in zip(completion.token_ids, completion.logprobs))


def test_top_p_samples_only_within_the_nucleus(llm):
    (prompt,) = _random_prompts(5, [15])
    p = 0.15
    out = llm.generate(_tp(prompt), SamplingParams(temperature=1.0, seed=11, top_p=p, max_tokens=24, logprobs=20))
    completion = out[0].outputs[0]
    for token, step in zip(completion.token_ids, completion.logprobs):
        rank = step[token].rank
        assert rank <= 20
        above = [lp.logprob for t, lp in step.items() if lp.rank < rank]
        assert len(above) == rank - 1
        # Every more likely token together stays below p, else this one would be cut.
        assert sum(math.exp(x) for x in above) < p + 1e-9
    assert any(step[t].rank > 1 for t, step in zip(completion.token_ids, completion.logprobs))


def test_min_p_drops_unlikely_tokens(llm):
    (prompt,) = _random_prompts(6, [15])
    min_p = 0.3
    out = llm.generate(_tp(prompt), SamplingParams(temperature=1.0, seed=13, min_p=min_p, max_tokens=24, logprobs=1))
    completion = out[0].outputs[0]
    for token, step in zip(completion.token_ids, completion.logprobs):
        top1 = next(lp for lp in step.values() if lp.rank == 1)
        assert math.exp(step[token].logprob) >= min_p * math.exp(top1.logprob) - 1e-12
    assert any(step[t].rank > 1 for t, step in zip(completion.token_ids, completion.logprobs))


# -- penalties ---------------------------------------------------------------------

def _num_repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_penalties_change_the_greedy_choice(llm):
    prompts = _random_prompts(5, [3, 10, 25, 40])
    base = [o.outputs[0].token_ids for o in
            llm.generate([_tp(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=32))]
    assert sum(_num_repeats(t) for t in base) > 0  # premise: plain greedy repeats itself here

    rep = llm.generate([_tp(p) for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=100.0))
    for prompt, out in zip(prompts, rep):
        ids = out.outputs[0].token_ids
        # Seen tokens (prompt or output) lose to unseen ones.
        assert _num_repeats(ids) == 0
        assert not set(ids) & set(prompt)

    for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0)):
        outs = llm.generate([_tp(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=32, **kw))
        penalised = [o.outputs[0].token_ids for o in outs]
        assert sum(_num_repeats(t) for t in penalised) < sum(_num_repeats(t) for t in base), kw
        # Up to the first repeat of the plain run, nothing is penalised yet.
        for b, pen in zip(base, penalised):
            first_repeat = next((i for i, t in enumerate(b) if t in b[:i]), len(b))
            assert pen[:first_repeat] == b[:first_repeat]


# -- n > 1 -------------------------------------------------------------------------

def test_n_samples_are_distinct_indexed_and_reproducible(llm):
    (prompt,) = _random_prompts(7, [30])
    params = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=16)
    first = llm.generate(_tp(prompt), params)
    assert len(first) == 1
    completions = first[0].outputs
    assert [c.index for c in completions] == [0, 1, 2, 3]
    ids = [tuple(c.token_ids) for c in completions]
    assert all(len(t) == 16 for t in ids)
    assert len(set(ids)) == 4
    again = llm.generate(_tp(prompt), params)[0].outputs
    assert [tuple(c.token_ids) for c in again] == ids
    # Child i samples with seed + i, as vLLM does.
    for i, c in enumerate(completions):
        single = llm.generate(_tp(prompt), SamplingParams(temperature=1.0, seed=42 + i, max_tokens=16))
        assert single[0].outputs[0].token_ids == c.token_ids


def test_n_unseeded_samples_are_distinct(llm):
    (prompt,) = _random_prompts(8, [12])
    out = llm.generate(_tp(prompt), SamplingParams(n=3, temperature=1.0, max_tokens=12))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_n_greedy_samples_equal_single_greedy(llm):
    (prompt,) = _random_prompts(9, [45])
    single = _greedy(llm, _tp(prompt), 10).token_ids
    out = llm.generate(_tp(prompt), SamplingParams(n=3, temperature=0.0, max_tokens=10))[0]
    assert [c.token_ids for c in out.outputs] == [single] * 3


def test_n_samples_share_the_prompt_blocks(llm):
    (prompt,) = _random_prompts(10, [100])
    n = 4
    before = llm.stats.prefix_cache_hits
    out = llm.generate(_tp(prompt), SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=8))[0]
    hits = llm.stats.prefix_cache_hits - before
    prompt_blocks = math.ceil(len(prompt) / BLOCK_SIZE)
    # Every sample after the first reuses all the prompt's full blocks but the
    # one holding the last token (its logits must be computed).
    assert hits >= (n - 1) * (prompt_blocks - 1) * BLOCK_SIZE
    assert len(out.outputs) == n
    # Rerunning the same prompt: every sample, the first included, hits.
    before = llm.stats.prefix_cache_hits
    out = llm.generate(_tp(prompt), SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=8))[0]
    assert llm.stats.prefix_cache_hits - before >= n * (prompt_blocks - 1) * BLOCK_SIZE
    assert out.num_cached_tokens == (prompt_blocks - 1) * BLOCK_SIZE


# -- stop conditions ---------------------------------------------------------------

def test_max_tokens_gives_length_and_exact_count(llm):
    for n in (1, 7):
        out = _greedy(llm, _tp(_random_prompts(11, [10])[0]), n)
        assert len(out.token_ids) == n
        assert out.finish_reason == "length"
        assert out.stop_reason is None


@pytest.mark.parametrize("prompt", EOS_PROMPTS, ids=["eos-prompt-a", "eos-prompt-b"])
def test_eos_stops_and_ignore_eos_goes_on(llm, prompt):
    out = _greedy(llm, _tp(prompt), 8)
    assert out.token_ids and out.token_ids[-1] in EOS_IDS, f"premise: greedy on {prompt} should hit EOS"
    assert len(out.token_ids) < 8
    assert out.finish_reason == "stop"
    assert out.stop_reason is None  # vLLM: None for EOS
    eos_at = len(out.token_ids) - 1
    # EOS is a special token: skipped in the text.
    assert out.text == llm.get_tokenizer().decode(out.token_ids[:-1])

    ignored = _greedy(llm, _tp(prompt), 8, ignore_eos=True)
    assert len(ignored.token_ids) == 8
    assert ignored.finish_reason == "length"
    assert ignored.token_ids[: eos_at + 1] == out.token_ids  # same greedy path, EOS kept

    # min_tokens bans EOS until min_tokens tokens exist.
    held = _greedy(llm, _tp(prompt), 8, min_tokens=eos_at + 3)
    assert len(held.token_ids) >= eos_at + 3
    assert not set(held.token_ids[: eos_at + 3]) & EOS_IDS
    if held.finish_reason == "stop":
        assert held.token_ids[-1] in EOS_IDS
    else:
        assert held.finish_reason == "length" and len(held.token_ids) == 8


def test_explicit_stop_token_id_stops_even_with_ignore_eos(llm):
    prompt = EOS_PROMPTS[0]
    eos = _greedy(llm, _tp(prompt), 8).token_ids[-1]
    assert eos in EOS_IDS
    out = _greedy(llm, _tp(prompt), 8, ignore_eos=True, stop_token_ids=[eos])
    assert out.token_ids[-1] == eos and len(out.token_ids) < 8
    assert out.finish_reason == "stop"
    assert out.stop_reason == eos  # an explicit stop token id is reported


def test_stop_token_ids(llm):
    (prompt,) = _random_prompts(12, [20])
    full = _greedy(llm, _tp(prompt), 24).token_ids
    assert len(full) == 24
    t = full[4]
    first = full.index(t)
    out = _greedy(llm, _tp(prompt), 24, stop_token_ids=[t])
    assert out.token_ids == full[: first + 1]  # the stop token id stays in token_ids
    assert out.finish_reason == "stop"
    assert out.stop_reason == t


def test_min_tokens_keeps_going_past_a_stop_token(llm):
    (prompt,) = _random_prompts(12, [20])
    full = _greedy(llm, _tp(prompt), 24).token_ids
    t = full[4]
    first = full.index(t)
    min_tokens = first + 3
    out = _greedy(llm, _tp(prompt), 24, stop_token_ids=[t], min_tokens=min_tokens)
    ids = out.token_ids
    assert len(ids) >= min_tokens
    assert ids[:first] == full[:first]  # nothing changes before the banned position
    assert t not in ids[:min_tokens]
    if out.finish_reason == "stop":
        assert ids[-1] == t and out.stop_reason == t and t not in ids[:-1]
    else:
        assert out.finish_reason == "length" and len(ids) == 24


def _clean_greedy(llm, tok, max_tokens=24):
    """A text prompt whose greedy output decodes to plain ASCII (so string
    positions are unambiguous) and its output."""
    for text in ("The weather today is", "Once upon a time", "def main():", "Hello, my name is", "In 1998 the"):
        out = _greedy(llm, text, max_tokens)
        if out.text.isascii() and len(out.text) >= 30:
            return text, out
    pytest.fail("no candidate prompt gives an ASCII greedy output")


def _text_of(tok, prompt: str, ids: list[int]) -> str:
    prompt_ids = tok.encode(prompt)
    return tok.decode(prompt_ids + ids, skip_special_tokens=True)[len(tok.decode(prompt_ids)) :]


def _stop_string(tok, prompt: str, out, start: int = 6) -> tuple[str, int]:
    """A stop string made of the text of two output tokens from ``start`` on,
    occurring once in the greedy text; and how many output tokens complete it."""
    assert _text_of(tok, prompt, out.token_ids) == out.text
    for i in range(start, len(out.token_ids) - 2):
        s = tok.decode(out.token_ids[i : i + 2], skip_special_tokens=True)
        if len(s) >= 3 and out.text.count(s) == 1:
            j = next(j for j in range(1, len(out.token_ids) + 1) if s in _text_of(tok, prompt, out.token_ids[:j]))
            return s, j
    raise AssertionError("no usable stop string in the greedy output")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(llm, tok, include):
    prompt, full = _clean_greedy(llm, tok)
    s, j = _stop_string(tok, prompt, full)
    cut = full.text.index(s)
    out = _greedy(llm, prompt, 24, stop=[s], include_stop_str_in_output=include)
    assert out.finish_reason == "stop"
    assert out.stop_reason == s
    assert out.text == (full.text[: cut + len(s)] if include else full.text[:cut])
    if not include:
        assert s not in out.text
    # Generation ended at the token that completed the stop string.
    assert out.token_ids == full.token_ids[:j]
    assert j < len(full.token_ids)


def test_earliest_stop_string_wins_end_to_end(llm, tok):
    prompt, full = _clean_greedy(llm, tok)
    late, _ = _stop_string(tok, prompt, full)
    early = full.text[1:4]
    assert full.text.index(early) < full.text.index(late)
    out = _greedy(llm, prompt, 24, stop=[late, early])
    assert out.stop_reason == early
    assert out.text == full.text[: full.text.index(early)]


def test_min_tokens_suppresses_stop_strings(llm, tok):
    prompt, full = _clean_greedy(llm, tok)
    s, j = _stop_string(tok, prompt, full)
    # The only occurrence completes with token j: min_tokens=j ignores it...
    out = _greedy(llm, prompt, 24, stop=[s], min_tokens=j)
    assert out.finish_reason == "length"
    assert out.token_ids == full.token_ids
    assert out.text == full.text
    # ... and min_tokens=j-1 does not.
    out = _greedy(llm, prompt, 24, stop=[s], min_tokens=j - 1)
    assert out.finish_reason == "stop" and out.stop_reason == s
    assert out.token_ids == full.token_ids[:j]


def test_max_model_len_caps_output(tiny_llama):
    llm = LLM(str(tiny_llama), **{**ENGINE_KW, "max_model_len": 64, "kv_cache_memory_bytes": 8 << 20})
    lengths = [30, 50, 60, 63, 64]
    prompts = _random_prompts(13, lengths)
    outs = llm.generate([_tp(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for n, out in zip(lengths, outs):
        c = out.outputs[0]
        # Finished once prompt + output reaches max_model_len (at least one token is sampled).
        assert len(c.token_ids) == max(1, min(32, 64 - n)), n
        assert c.finish_reason == "length"
    # Without max_tokens, max_model_len alone ends the request.
    out = llm.generate(_tp(prompts[1]), SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 64 - 50
    assert out[0].outputs[0].finish_reason == "length"


# -- output text -------------------------------------------------------------------

def test_text_with_and_without_special_tokens(llm, tok):
    prompt = "Once upon a time"
    prompt_ids = tok.encode(prompt)
    plain = _greedy(llm, prompt, 16)
    special = _greedy(llm, prompt, 16, skip_special_tokens=False)
    assert special.token_ids == plain.token_ids
    for out, skip in ((plain, True), (special, False)):
        full = tok.decode(prompt_ids + out.token_ids, skip_special_tokens=skip)
        assert out.text == full[len(tok.decode(prompt_ids)) :]
    # The model emits reserved (special) tokens here, so the two texts differ.
    assert any(t >= 6065 for t in plain.token_ids)
    assert "<|reserved_" in special.text and "<|reserved_" not in plain.text


def test_output_text_does_not_repeat_a_prompt_cut_inside_a_character(llm, tok):
    ids = tok.encode("The quick naïve")
    k = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    prompt_ids = ids[:k]
    out = _greedy(llm, _tp(prompt_ids), 8)
    full = tok.decode(prompt_ids + out.token_ids, skip_special_tokens=True)
    prompt_text = tok.decode(prompt_ids).rstrip("\ufffd")  # "The quick na"
    assert full.startswith(prompt_text)
    assert full.endswith(out.text)
    # At most the complete characters of the last prompt token (held back
    # while its text ended mid-character) may precede the new text; never
    # the rest of the prompt.
    held_back = tok.decode(prompt_ids[-1:]).rstrip("\ufffd")
    assert len(out.text) <= len(full) - len(prompt_text) + len(held_back)


# -- logprobs ----------------------------------------------------------------------

def test_greedy_logprobs(llm, tok):
    (prompt,) = _random_prompts(14, [25])
    k = 5
    c = _greedy(llm, _tp(prompt), 10, logprobs=k)
    assert len(c.logprobs) == len(c.token_ids) == 10
    for token, step in zip(c.token_ids, c.logprobs):
        assert token in step
        assert step[token].rank == 1  # greedy picks the top token
        assert len(step) == k  # the sampled token is one of the top-k
        ranked = sorted(step.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == list(range(1, k + 1))
        values = [lp.logprob for lp in ranked]
        assert all(v <= 0 for v in values)
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-9
        for tid, lp in step.items():
            assert lp.decoded_token == tok.decode([tid], skip_special_tokens=False)
    assert c.cumulative_logprob == pytest.approx(sum(step[t].logprob for t, step in zip(c.token_ids, c.logprobs)))


def test_sampled_logprobs_ranks(llm):
    (prompt,) = _random_prompts(15, [25])
    k = 2
    c = llm.generate(_tp(prompt), SamplingParams(temperature=1.5, seed=1, max_tokens=24, logprobs=k))[0].outputs[0]
    outside = 0
    for token, step in zip(c.token_ids, c.logprobs):
        entry = step[token]
        top = [lp for lp in step.values() if lp.rank <= k]
        assert sorted(lp.rank for lp in top) == list(range(1, k + 1))
        if entry.rank > k:
            outside += 1
            assert len(step) == k + 1  # the sampled token plus the top k
            assert all(entry.logprob <= lp.logprob for lp in top)
        else:
            assert len(step) == k
        assert entry.logprob <= 0
    assert outside > 0  # at temperature 1.5 some samples fall outside the top 2


def test_logprobs_are_of_the_raw_distribution(llm):
    (prompt,) = _random_prompts(16, [18])
    greedy = _greedy(llm, _tp(prompt), 1, logprobs=20).logprobs[0]
    hot = llm.generate(
        _tp(prompt),
        SamplingParams(temperature=0.5, seed=2, max_tokens=1, logprobs=20, repetition_penalty=1.5, top_k=5),
    )[0].outputs[0].logprobs[0]
    top_greedy = {t: lp.logprob for t, lp in greedy.items() if lp.rank <= 20}
    top_hot = {t: lp.logprob for t, lp in hot.items() if lp.rank <= 20}
    assert top_hot.keys() == top_greedy.keys()
    for t in top_greedy:
        assert top_hot[t] == pytest.approx(top_greedy[t], abs=1e-9)


def test_logprobs_zero_and_none(llm):
    (prompt,) = _random_prompts(17, [8])
    c = _greedy(llm, _tp(prompt), 4, logprobs=0)
    assert [list(step) for step in c.logprobs] == [[t] for t in c.token_ids]
    assert all(step[t].rank == 1 for t, step in zip(c.token_ids, c.logprobs))
    c = _greedy(llm, _tp(prompt), 4)
    assert c.logprobs is None and c.cumulative_logprob is None
