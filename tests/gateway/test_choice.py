"""Streaming one choice: text deltas never take back text, stop strings
that span responses, finish reasons and logprobs."""

from __future__ import annotations

import pytest

from gateway.choice import ChoiceState
from gateway.request import SamplingOptions
from tessera.text import load_tokenizer
from tessera.v1 import engine_pb2 as epb


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


def _feed(state: ChoiceState, ids: list[int], per_response: int = 1, finish_last: str = "length"):
    updates = []
    for i in range(0, len(ids), per_response):
        last = i + per_response >= len(ids)
        resp = epb.GenerateResponse(token_ids=ids[i:i + per_response], finish_reason=finish_last if last else "")
        updates.append(state.on_response(resp))
        if state.finished:
            break
    return updates


def test_streamed_deltas_concatenate_to_the_text(tokenizer):
    ids = tokenizer.encode(" the platform routes requests to engine pods", add_special_tokens=False)
    state = ChoiceState(0, tokenizer, tokenizer.encode("Hello"), SamplingOptions())
    updates = _feed(state, ids)
    assert "".join(u.text for u in updates) == " the platform routes requests to engine pods"
    assert updates[-1].finish_reason == "length" and state.num_tokens == len(ids)


def test_stop_string_spanning_two_responses_never_leaks(tokenizer):
    text = " alpha beta gamma delta epsilon"
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = ChoiceState(0, tokenizer, [], SamplingOptions(stop=["gamma del"]))
    updates = _feed(state, ids, per_response=1)
    streamed = "".join(u.text for u in updates)
    assert streamed == " alpha beta "  # nothing of the stop string was ever sent
    assert updates[-1].finish_reason == "stop" and updates[-1].stop_reason == "gamma del"
    assert state.finished


def test_include_stop_string_and_stop_token(tokenizer):
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    state = ChoiceState(0, tokenizer, [], SamplingOptions(stop=["three"], include_stop_str_in_output=True))
    assert "".join(u.text for u in _feed(state, ids)) == " one two three"
    state = ChoiceState(1, tokenizer, [], SamplingOptions())
    update = state.on_response(epb.GenerateResponse(token_ids=ids[:2], finish_reason="stop", stop_token_id=2))
    assert update.index == 1 and update.finish_reason == "stop" and update.stop_reason == 2


def test_logprobs_and_cached_tokens(tokenizer):
    state = ChoiceState(0, tokenizer, [], SamplingOptions(logprobs=1))
    resp = epb.GenerateResponse(token_ids=[100], num_cached_tokens=32, logprobs=[epb.TokenLogprobs(entries=[
        epb.TokenLogprob(token_id=100, logprob=-0.5, rank=2), epb.TokenLogprob(token_id=7, logprob=-0.1, rank=1)])])
    update = state.on_response(resp)
    (lp,) = update.logprobs
    assert (lp.token_id, lp.logprob) == (100, -0.5) and lp.token == tokenizer.decode([100])
    assert lp.top == [(7, tokenizer.decode([7]), pytest.approx(-0.1))]
    assert state.num_cached_tokens == 32
