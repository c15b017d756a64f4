"""The character-at-a-time JSON scanner agrees with json.loads: it takes
every character of valid JSON and is done exactly at its end, and it
refuses (or is not done with) what json.loads refuses."""

from __future__ import annotations

import json
import random

import pytest

from gateway.tool_calls.json_scan import JsonScanner


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] * 2 if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 7, 10**20, -(10**5)])
    if kind == "float":
        return rng.choice([0.5, -2.25e-7, 1e300, 3.0])
    if kind == "str":
        return "".join(rng.choice(['a', '"', '\\', '\n', '\t', 'é', '☕', '\x01', '/', ' ', '\ud83d']) for _ in
                       range(rng.randint(0, 6)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i}\"": _random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}


def _random_json(rng: random.Random) -> str:
    value = {"v": _random_value(rng)} if rng.random() < 0.7 else [_random_value(rng)]
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]),
                      separators=rng.choice([None, (",", ":"), (" , ", " : ")]))


def _scan(text: str) -> tuple[bool, bool]:
    """(every character taken, done at the end)."""
    scanner = JsonScanner()
    for i, ch in enumerate(text):
        if not scanner.feed(ch):
            return False, False
        if scanner.done and i != len(text) - 1:
            return False, False  # done before the end
    return True, scanner.done


def _loads(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_valid_json_is_taken_whole_and_done_at_its_end():
    rng = random.Random(7)
    for _ in range(150):
        text = _random_json(rng)
        assert _scan(text) == (True, True), text
        for cut in range(len(text) - 1):  # every proper prefix: taken, not done
            assert _scan(text[:cut]) == (True, False) or text[:cut].strip() == "", text[:cut]


def test_mutated_json_is_refused_exactly_when_json_loads_refuses_it():
    rng = random.Random(11)
    alphabet = list('{}[]:,"\\ 0123456789-+.eEtrufalsn\x01u')
    for _ in range(3000):
        text = _random_json(rng)
        at = rng.randrange(len(text))
        edit = rng.choice(["insert", "delete", "replace"])
        if edit == "insert":
            text = text[:at] + rng.choice(alphabet) + text[at:]
        elif edit == "delete":
            text = text[:at] + text[at + 1:]
        else:
            text = text[:at] + rng.choice(alphabet) + text[at + 1:]
        text = text.rstrip(" ")  # the scanner reads one value: nothing after it
        taken, done = _scan(text)
        assert (taken and done) == _loads(text), text


@pytest.mark.parametrize("text", [
    '{"a": 01}', '{"a": 1.}', '{"a": .5}', '{"a": -}', '{"a": 1e}', '{"a": +1}', '{"a": tru}', '{"a": "\\x"}',
    '{"a": "\\u12g4"}', '{"a": "\\u123"}', '{"a": "\t"}', '{a: 1}', '{"a" 1}', '{"a": 1,}', '[1,]', '{"a": NaN}',
    '{"a": [1}', "{'a': 1}"])
def test_invalid_json_is_refused(text):
    assert _scan(text) != (True, True)


def test_nesting_is_bounded():
    scanner = JsonScanner(max_depth=3)
    assert all(scanner.feed(ch) for ch in "[[[")
    assert not scanner.feed("[")
