"""The token ids of a simulated engine: a function of the prompt and the
position alone, never an EOS id."""

from __future__ import annotations

import pytest

from engine_pod.sim.tokens import prompt_seed, simulated_output, simulated_token


def test_outputs_are_deterministic_and_depend_on_every_prompt_token():
    prompt = list(range(100, 140))
    first = simulated_output(prompt, 16, 8192, {1})
    assert first == simulated_output(prompt, 16, 8192, {1})
    assert first != simulated_output([*prompt[:-1], 7], 16, 8192, {1})
    assert first != simulated_output([5, *prompt[1:]], 16, 8192, {1})
    assert len(set(first)) > 8  # spread over the vocabulary, not a constant


def test_a_longer_output_extends_a_shorter_one():
    prompt = [3, 4, 5]
    assert simulated_output(prompt, 10, 512, set())[:4] == simulated_output(prompt, 4, 512, set())


def test_position_not_call_order_decides_the_token():
    seed = prompt_seed([9, 9, 9])
    assert simulated_token(seed, 7, 1000, set()) == simulated_token(seed, 7, 1000, set())
    assert [simulated_token(seed, p, 1000, set()) for p in (3, 4)] != [simulated_token(seed, 3, 1000, set())] * 2


def test_eos_ids_are_never_emitted():
    vocab = 4
    eos = {0, 1, 2}
    out = simulated_output([1, 2, 3], 50, vocab, eos)
    assert set(out) == {3}
    with pytest.raises(ValueError, match="every token id"):
        simulated_token(1, 1, 2, {0, 1})
