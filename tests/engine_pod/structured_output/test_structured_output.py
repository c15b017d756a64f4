"""The grammar side of guided decoding, on xgrammar and the tiny tokenizer:
bitmask application against xgrammar's own kernel, the bitmask rows the
runner sees, and what speculative decoding will need (draft validation and
per-position masks, both leaving the matcher unchanged)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import xgrammar as xgr

from engine_pod.sample.ops import apply_grammar_bitmask
from engine_pod.structured_output.backend_xgrammar import Grammar, XgrammarBackend
from engine_pod.structured_output.bitmask import GrammarBitmask
from tessera.structured_output import StructuredOutputsParams
from tessera.text import load_tokenizer

VOCAB = 8192  # the tiny checkpoint's logits width


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return XgrammarBackend(tokenizer, VOCAB, [1, 3])


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    masked = apply_grammar_bitmask(logits, bitmask[row : row + 1])
    return set(torch.nonzero(masked[0] == 0).flatten().tolist())


def test_apply_grammar_bitmask_matches_xgrammar(backend, tokenizer):
    grammar = Grammar.create(backend.compile(StructuredOutputsParams(regex=r"[0-9]{2}[a-c]")))
    bitmask = backend.allocate_bitmask(3)
    grammar.fill_bitmask(bitmask, 0)
    bitmask[1] = torch.randint(-(2**31), 2**31 - 1, (bitmask.shape[1],), dtype=torch.int32)  # arbitrary bits
    # row 2 stays all-allowed
    logits = torch.randn(3, VOCAB)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    assert torch.equal(apply_grammar_bitmask(logits, bitmask), expected)
    assert torch.isfinite(expected[2]).all()
    allowed = torch.nonzero(torch.isfinite(expected[0])).flatten().tolist()
    assert allowed and all(re.fullmatch(r"[0-9]{1,2}|[0-9]{2}[a-c]", tokenizer.decode([t])) for t in allowed)


def test_bitmask_rows_follow_the_runner_order():
    mask = GrammarBitmask(["b", "d"], np.array([[7, 7], [9, 9]], dtype=np.int32))
    rows = mask.rows_for(["a", "d", "b"], [1, 1, 1])
    assert rows.tolist() == [[-1, -1], [9, 9], [7, 7]]
    assert mask.rows_for(["a", "c"], [1, 1]) is None


def test_bitmask_rows_expand_per_draft_position():
    # "b" verifies two drafts (three rows), "a" is unguided with one draft.
    mask = GrammarBitmask(["b", "b", "b", "d"], np.array([[1, 1], [2, 2], [3, 3], [9, 9]], dtype=np.int32))
    rows = mask.rows_for(["a", "b", "d"], [2, 3, 1])
    assert rows.tolist() == [[-1, -1], [-1, -1], [1, 1], [2, 2], [3, 3], [9, 9]]


def test_validate_drafts_counts_the_accepted_prefix_without_advancing(backend, tokenizer):
    grammar = Grammar.create(backend.compile(StructuredOutputsParams(choice=["hello world", "help"])))
    good = _encode(tokenizer, "hello world")
    assert grammar.validate_tokens(good) == len(good)
    bad = good[:1] + _encode(tokenizer, "zzz")
    assert grammar.validate_tokens(bad) == 1
    assert grammar.validate_tokens([]) == 0
    # The matcher did not move: the whole answer is still acceptable from the start.
    assert grammar.accept_tokens(good)
    assert grammar.accept_tokens([1]) and grammar.is_terminated()


def test_fill_bitmasks_gives_each_draft_position_its_mask_then_rolls_back(backend, tokenizer):
    params = StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
                                           "required": ["n"]})
    grammar = Grammar.create(backend.compile(params))
    drafts = _encode(tokenizer, '{"n":')
    bitmask = backend.allocate_bitmask(len(drafts) + 1)
    assert grammar.fill_bitmasks(bitmask, 0, drafts) == len(drafts) + 1
    # Reference: a fresh matcher stepped through the drafts one by one.
    reference = Grammar.create(backend.compile(params))
    ref_mask = backend.allocate_bitmask(len(drafts) + 1)
    for i, token in enumerate(drafts):
        reference.fill_bitmask(ref_mask, i)
        assert reference.accept_tokens([token])
    reference.fill_bitmask(ref_mask, len(drafts))
    assert torch.equal(bitmask, ref_mask)
    assert _allowed(bitmask, len(drafts)) <= set(_encode(tokenizer, "0123456789")) | \
        {t for t in range(VOCAB) if tokenizer.decode([t]).isdigit()}
    # Rolled back: the first mask is the one of the untouched matcher.
    again = backend.allocate_bitmask(1)
    grammar.fill_bitmask(again, 0)
    assert torch.equal(again[0], bitmask[0])


def test_fill_bitmasks_stops_at_a_refused_draft(backend, tokenizer):
    grammar = Grammar.create(backend.compile(StructuredOutputsParams(regex="[0-9]+")))
    digit = _encode(tokenizer, "7")
    letter = _encode(tokenizer, "x")
    drafts = digit + letter + digit
    bitmask = backend.allocate_bitmask(len(drafts) + 1)
    assert grammar.fill_bitmasks(bitmask, 0, drafts) == 2  # before and after the digit
    assert torch.all(bitmask[2:] == -1)  # past the refused draft: untouched
    assert grammar.validate_tokens(drafts) == 1


def test_compile_cache_is_bounded_least_recently_used_first(tiny_llama):
    from engine_pod.request import Request
    from engine_pod.sampling_params import SamplingParams
    from engine_pod.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(tiny_llama, VOCAB, {1, 3}, max_cached=2)
    regexes = ["a+", "b+", "a+", "c+", "b+"]
    for i, regex in enumerate(regexes):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex))
        manager.add_request(Request(str(i), [5], params))
    # a+ compiles, b+ compiles, a+ hits (now most recent), c+ compiles and
    # drops b+ (least recent), b+ compiles again.
    assert (manager.stats.num_compiles, manager.stats.num_cache_hits) == (4, 1)
    manager.wait_for_compiles(timeout=30)
    manager.shutdown()


def test_manager_masks_drafted_positions_and_validates_drafts(tiny_llama, tokenizer):
    from engine_pod.request import Request
    from engine_pod.sampling_params import SamplingParams
    from engine_pod.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(tiny_llama, VOCAB, {1, 3})
    guided = Request("g", [5], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]{2}")))
    manager.add_request(guided)
    manager.wait_for_compiles(timeout=30)
    assert manager.is_ready(guided)
    drafts = _encode(tokenizer, "4") + _encode(tokenizer, "2")
    mask = manager.grammar_bitmask(["plain", "g"], drafts={"g": drafts})
    assert mask.req_ids == ["g", "g", "g"]  # 1 + 2 drafted positions; "plain" has no grammar
    digits = {t for t in range(VOCAB) if re.fullmatch(r"[0-9]{1,2}", tokenizer.decode([t]))}
    assert _allowed(torch.from_numpy(mask.bitmask), 0) == digits
    assert _allowed(torch.from_numpy(mask.bitmask), 2) == {1, 3}  # two digits: only a stop token
    assert manager.validate_tokens("g", drafts + drafts) == 2
    assert manager.validate_tokens("plain", drafts) == 2  # no grammar: everything passes
    # None of that moved the matcher.
    assert manager.accept_tokens("g", drafts) and not manager.is_terminated("g")
    assert manager.accept_tokens("g", [3]) and manager.is_terminated("g")
    manager.shutdown()


@pytest.mark.parametrize("string_schema", [{"type": "string", "maxLength": 8}, {"type": "string", "minLength": 1},
                                           {"type": "string"}], ids=["maxLength", "minLength", "unbounded"])
def test_json_strings_hold_no_raw_control_character(backend, string_schema):
    """JSON forbids raw U+0000-U+001F in strings; xgrammar's bounded strings allowed them (a sampled
    tool call's arguments then did not parse)."""
    schema = {"type": "object", "properties": {"a": string_schema}, "required": ["a"], "additionalProperties": False}
    compiled = backend.compile(StructuredOutputsParams(json=schema))
    for text, valid in (('{"a":"ok é"}', True), ('{"a":"x\x1e"}', False), ('{"a":"\x04"}', False),
                        ('{"a":"x\ty"}', False)):
        assert xgr.GrammarMatcher(compiled).accept_string(text) is valid, text
