"""The chained block hash (kv_store/block_hash.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams
from kv_store.block_hash import NONE_HASH, hash_block_tokens, hash_request_tokens

BS = 4
TOKENS = list(range(100, 116))  # 4 full blocks of 4
REPO = Path(__file__).resolve().parents[2]


def test_same_input_same_bytes_across_calls():
    a = hash_request_tokens(TOKENS, BS, cache_salt="tenant")
    b = hash_request_tokens(list(TOKENS), BS, cache_salt="tenant")
    assert a == b
    assert len(a) == 4
    assert all(isinstance(h, bytes) and len(h) == 32 for h in a)  # SHA-256 digests
    assert len(set(a)) == 4
    assert hash_block_tokens(None, TOKENS[:4]) == hash_block_tokens(None, tuple(TOKENS[:4]))


def test_digest_does_not_depend_on_python_hash_seed():
    # Python's hash() of a str changes with PYTHONHASHSEED; the block hash must not.
    code = (
        "from kv_store.block_hash import hash_request_tokens;"
        f"print(b''.join(hash_request_tokens({TOKENS!r}, {BS}, cache_salt='tenant-a')).hex())"
    )
    outs = []
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        res = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                             check=True)
        outs.append(res.stdout.strip())
    assert outs[0] == outs[1]
    assert outs[0] == b"".join(hash_request_tokens(TOKENS, BS, cache_salt="tenant-a")).hex()


def test_first_block_parent_is_the_fixed_seed():
    # None as parent means "the fixed seed", identical to passing the seed itself.
    assert hash_block_tokens(None, TOKENS[:4]) == hash_block_tokens(NONE_HASH, TOKENS[:4])
    assert hash_request_tokens(TOKENS, BS)[0] == hash_block_tokens(None, TOKENS[:4])


def test_chaining_change_in_earlier_block_changes_every_later_hash():
    base = hash_request_tokens(TOKENS, BS)
    changed_tokens = list(TOKENS)
    changed_tokens[5] += 1  # inside block 1
    changed = hash_request_tokens(changed_tokens, BS)
    assert changed[0] == base[0]
    for i in range(1, 4):
        assert changed[i] != base[i], i
    # A later block with identical tokens but a different parent hashes differently.
    assert hash_block_tokens(base[1], TOKENS[8:12]) != hash_block_tokens(changed[1], TOKENS[8:12])


def test_each_hash_chains_on_the_previous_one():
    hashes = hash_request_tokens(TOKENS, BS)
    parent = None
    for i, h in enumerate(hashes):
        assert h == hash_block_tokens(parent, TOKENS[i * BS : (i + 1) * BS])
        parent = h


def test_only_full_blocks_are_hashed():
    assert hash_request_tokens(TOKENS[:3], BS) == []
    ten = hash_request_tokens(TOKENS[:10], BS)
    assert len(ten) == 2
    assert ten == hash_request_tokens(TOKENS[:8], BS)
    # The partial trailing block does not influence the hashes of the full ones.
    other_tail = TOKENS[:8] + [999, 998]
    assert hash_request_tokens(other_tail, BS) == ten
    assert len(hash_request_tokens(TOKENS, BS)) == len(TOKENS) // BS


def test_cache_salt_changes_first_and_therefore_all_hashes():
    plain = hash_request_tokens(TOKENS, BS)
    salt_a = hash_request_tokens(TOKENS, BS, cache_salt="a")
    salt_b = hash_request_tokens(TOKENS, BS, cache_salt="b")
    assert salt_a == hash_request_tokens(TOKENS, BS, cache_salt="a")
    for i in range(len(plain)):
        assert len({plain[i], salt_a[i], salt_b[i]}) == 3, i
    # The salt only enters block 0; later blocks differ through the chain.
    assert salt_a[1] == hash_block_tokens(salt_a[0], TOKENS[4:8])


def test_incremental_extension_equals_hashing_all_at_once():
    for salt in (None, "s"):
        full = hash_request_tokens(TOKENS, BS, cache_salt=salt)
        for start in range(len(full) + 1):
            parent = full[start - 1] if start else None
            tail = hash_request_tokens(TOKENS, BS, cache_salt=salt, start_block=start, parent_hash=parent)
            assert full[:start] + tail == full, (salt, start)


def test_request_hashes_incrementally_as_tokens_arrive():
    req = Request("r", TOKENS[:6], SamplingParams(max_tokens=20), cache_salt="x")
    req.enable_block_hashing(BS)
    assert len(req.block_hashes) == 1
    for tok in TOKENS[6:]:
        req.append_output_token_ids([tok])
    assert req.block_hashes == hash_request_tokens(TOKENS, BS, cache_salt="x")


def test_start_block_without_parent_raises():
    with pytest.raises(ValueError):
        hash_request_tokens(TOKENS, BS, start_block=1)


@pytest.mark.parametrize("bad", [1.5, None, True, [1], object()])
def test_bad_extra_key_type_raises_type_error(bad):
    with pytest.raises(TypeError):
        hash_block_tokens(None, TOKENS[:4], ("ok", bad))


def test_extra_keys_are_type_tagged_and_length_prefixed():
    h = lambda keys: hash_block_tokens(None, TOKENS[:4], keys)  # noqa: E731
    assert h(("ab",)) != h(("a", "b"))
    assert len({h(("1",)), h((b"1",)), h((1,))}) == 3
    assert h(()) != h(("",))
    assert h(("x", 1)) == h(("x", 1))


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_bad_block_size_raises_value_error(block_size):
    with pytest.raises(ValueError):
        hash_request_tokens(TOKENS, block_size)
