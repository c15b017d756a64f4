"""The deployment's internal secret and its derived keys (tessera/internal_secret.py)."""

from __future__ import annotations

import pytest

from tessera.internal_secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    InternalSecret,
    InternalSecretError,
)

A = InternalSecret.from_text("a" * 40)
B = InternalSecret.from_text("b" * 40)


def test_derived_keys_differ_by_purpose_and_by_secret():
    keys = {A.token.encode(), A.kv_mac_key, A.cache_salt("tenant:x").encode(), B.kv_mac_key}
    assert len(keys) == 4
    assert A.kv_mac_key == InternalSecret.from_text("a" * 40 + "\n").kv_mac_key  # a file's newline is not part of it


def test_cache_salt_is_keyed_and_separates_identities():
    assert A.cache_salt("tenant:x") != A.cache_salt("tenant:y")
    assert A.cache_salt("tenant:x") != B.cache_salt("tenant:x")
    assert "tenant:x" not in A.cache_salt("tenant:x")


def test_token_check_is_exact():
    assert A.accepts(f"Bearer {A.token}")
    assert A.accepts(f"bearer {A.token}")
    for bad in (None, "", A.token, f"Bearer {B.token}", f"Basic {A.token}", f"Bearer {A.token[:-1]}"):
        assert not A.accepts(bad), bad


def test_load_prefers_a_file_and_never_echoes_the_secret(tmp_path):
    path = tmp_path / "s"
    path.write_text("f" * 40 + "\n")
    env = {SECRET_FILE_ENV: str(path), SECRET_ENV: "e" * 40}
    assert InternalSecret.load(environ=env).value == b"f" * 40
    assert InternalSecret.load(environ={SECRET_ENV: "e" * 40}).value == b"e" * 40
    assert InternalSecret.load(environ={}) is None
    short = "short-secret"
    with pytest.raises(InternalSecretError) as e:
        InternalSecret.load(environ={SECRET_ENV: short})
    assert short not in str(e.value)
    with pytest.raises(InternalSecretError, match="cannot read"):
        InternalSecret.load(environ={SECRET_FILE_ENV: str(tmp_path / "missing")})
    assert "f" * 40 not in repr(InternalSecret.load(environ=env))


def test_generated_secrets_are_long_and_distinct():
    a, b = InternalSecret.generate(), InternalSecret.generate()
    assert a.value != b.value and len(a.value) >= 32
