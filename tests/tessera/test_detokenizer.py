"""IncrementalDetokenizer with the tiny checkpoint's byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from tessera.text import IncrementalDetokenizer, load_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "café São Paulo naïve €5",
    "日本語 テキスト 🙂 — ok",
    "  leading spaces,\ttabs\nand newlines  ",
]
EOS = 1  # <|end_of_text|>


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return load_tokenizer(tiny_llama)


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str | None]:
    """One token per update, as the engine does; stops after a stop string
    (the engine aborts the request then)."""
    results = []
    for t in ids:
        results.append(detok.update([t]))
        if results[-1] is not None:
            break
    return results


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # the premise: the tokenizer round-trips
    detok = IncrementalDetokenizer(tok, [])
    seen = []
    for t in ids:
        assert detok.update([t]) is None
        seen.append(detok.output_text)
        # Never a replacement character for a half-finished UTF-8 sequence.
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == text
    assert detok.num_tokens == len(ids)
    # The text only ever grows.
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))


def test_multibyte_character_split_across_tokens(tok):
    ids = tok.encode("naïve")
    # The premise of this test: some token alone is not valid UTF-8.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tok, [])
    _feed(detok, ids)
    assert detok.output_text == "naïve"


@pytest.mark.parametrize("text", TEXTS)
def test_chunks_of_several_tokens_equal_full_decode(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [])
    for i in range(0, len(ids), 3):
        detok.update(ids[i : i + 3])
    assert detok.output_text == text


def test_prompt_context_is_used(tok):
    prompt, completion = "Hello", " world, and café!"
    prompt_ids = tok.encode(prompt)
    ids = tok.encode(prompt + completion)[len(prompt_ids) :]
    assert tok.encode(prompt + completion)[: len(prompt_ids)] == prompt_ids
    detok = IncrementalDetokenizer(tok, prompt_ids)
    _feed(detok, ids)
    # The leading space of the first output token is kept.
    assert detok.output_text == completion


def test_character_split_across_prompt_boundary(tok):
    text = "naïve €5 São"
    ids = tok.encode(text)
    # Split where the prompt ends inside the two bytes of "ï".
    k = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    prompt_ids, out_ids = ids[:k], ids[k:]
    detok = IncrementalDetokenizer(tok, prompt_ids)
    _feed(detok, out_ids)
    assert "\ufffd" not in detok.output_text
    # The character completed by the first output token is output whole.
    assert tok.decode(prompt_ids).rstrip("\ufffd") + detok.output_text == text


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("the end") + [EOS]
    skip = IncrementalDetokenizer(tok, [])
    _feed(skip, ids)
    assert skip.output_text == "the end"
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    _feed(keep, ids)
    assert keep.output_text == "the end<|end_of_text|>"


def _straddling_stop(tok, text: str) -> tuple[list[int], int, str]:
    """Token ids of ``text``, an index i and a stop string made of the last two
    characters of token i's text and the first two of token i+1's."""
    ids = tok.encode(text)
    pieces = [tok.decode([t]) for t in ids]
    for i in range(1, len(ids) - 1):
        a, b = pieces[i], pieces[i + 1]
        if len(a) >= 2 and len(b) >= 2 and a.isascii() and b.isascii():
            stop = a[-2:] + b[:2]
            if stop not in "".join(pieces[: i + 1]):
                return ids, i, stop
    raise AssertionError("no straddling stop string in the test text")


def test_stop_string_spanning_two_steps(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids, i, stop = _straddling_stop(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    results = _feed(detok, ids[: i + 2])
    # Not found while only its first half exists; found at the step completing it.
    assert results[: i + 1] == [None] * (i + 1)
    assert results[i + 1] == stop
    assert detok.output_text == text[: text.index(stop)]
    assert stop not in detok.output_text


def test_include_stop_str_in_output(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids, i, stop = _straddling_stop(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=True)
    results = _feed(detok, ids[: i + 2])
    assert results[i + 1] == stop
    assert detok.output_text == text[: text.index(stop) + len(stop)]
    assert detok.output_text.endswith(stop)


def test_earliest_of_several_stop_strings_wins(tok):
    text = "hello world, hello moon"
    ids = tok.encode(text)
    # Both complete within the same update; "lo w" starts earlier than "world".
    for stops in (["world", "lo w"], ["lo w", "world"], ["moon", "world", "lo w"]):
        detok = IncrementalDetokenizer(tok, [], stop=stops)
        assert detok.update(ids) == "lo w"
        assert detok.output_text == "hel"


def test_stop_found_in_an_earlier_step_wins_over_a_later_one(tok):
    text = "one two three four"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], stop=["four", "two"])
    results = _feed(detok, ids)
    assert "two" in results
    first = next(r for r in results if r is not None)
    assert first == "two"
    assert detok.output_text == "one "


def test_stop_at_the_very_start(tok):
    ids = tok.encode("Stop here")
    detok = IncrementalDetokenizer(tok, [], stop=["Stop"])
    results = _feed(detok, ids)
    assert "Stop" in results
    assert detok.output_text == ""


def test_min_tokens_suppresses_stop_checks(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids, i, stop = _straddling_stop(tok, text)
    # The stop completes with output token number i + 2 (1-based).
    suppressed = IncrementalDetokenizer(tok, [], stop=[stop], min_tokens=i + 2)
    assert _feed(suppressed, ids) == [None] * len(ids)
    assert suppressed.output_text == text  # never truncated

    allowed = IncrementalDetokenizer(tok, [], stop=[stop], min_tokens=i + 1)
    assert _feed(allowed, ids[: i + 2])[-1] == stop
    assert allowed.output_text == text[: text.index(stop)]


def test_no_stop_strings_never_stops(tok):
    ids = tok.encode("hello world")
    detok = IncrementalDetokenizer(tok, [], stop=[])
    assert _feed(detok, ids) == [None] * len(ids)
    assert detok.output_text == "hello world"


def test_stop_string_not_present(tok):
    ids = tok.encode("hello world")
    detok = IncrementalDetokenizer(tok, [], stop=["xyz", "worlds"])
    assert _feed(detok, ids) == [None] * len(ids)
    assert detok.output_text == "hello world"


def test_non_ascii_stop_string(tok):
    text = "café São Paulo naïve €5"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], stop=["ï"])
    results = _feed(detok, ids)
    assert "ï" in results
    assert detok.output_text == "café São Paulo na"


def test_decode_token(tok):
    ids = tok.encode("hello world")
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.decode_token(t) for t in ids] == [tok.decode([t]) for t in ids]
    assert detok.decode_token(EOS) == "<|end_of_text|>"


def test_encode_prompt_equals_the_tokenizers_encode(tiny_llama, tiny_qwen2):
    from tessera_tools.fixtures.tokenizer import corpus_lines
    from tessera.text import encode_prompt, load_tokenizer

    texts = ["", " ", "Hello, world!", "  leading spaces", "émigré naïve 東京 🚀", "line\nbreak\ttab",
             "<|reserved_5|> special in text", "def f(x):\n    return x ** 2\n"]
    texts += corpus_lines()[:200]
    for model in (tiny_llama, tiny_qwen2):
        tok = load_tokenizer(model)
        for text in texts:
            assert encode_prompt(tok, text) == tok.encode(text)
            assert encode_prompt(tok, text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
