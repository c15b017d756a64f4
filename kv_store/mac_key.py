"""The key of the MAC over shared KV values: how long it must be, checked in
one place (without torch: an engine's configuration is checked by processes
that never touch a tensor)."""

from __future__ import annotations

MIN_MAC_KEY_BYTES = 16


def check_mac_key(key: object) -> None:
    """ValueError unless ``key`` is None or bytes of at least MIN_MAC_KEY_BYTES."""
    if key is not None and (not isinstance(key, bytes) or len(key) < MIN_MAC_KEY_BYTES):
        raise ValueError(f"kv_mac_key must be bytes, at least {MIN_MAC_KEY_BYTES} of them")
