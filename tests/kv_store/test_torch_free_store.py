"""The store's byte transport without torch (what a simulated engine pod
runs): codec framing, the MAC, the host and Redis tiers, in a process where
torch cannot be imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def test_blocks_travel_through_redis_and_a_forgery_is_refused_without_torch(redis_server):
    script = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "from kv_store.host_tier import HostMemoryTier\n"
        "from kv_store.tiered_store import TieredKVStore\n"
        "from tests.kv_store.blocks import block_hash, make_codec, make_payload, make_redis_tier, tampered_payload\n"
        f"url = {redis_server.url!r}\n"
        "writer = TieredKVStore(make_codec(), HostMemoryTier(1 << 20), make_redis_tier(url))\n"
        "writer.put(block_hash(0), make_payload(0), sync_remote=True)\n"
        "writer.put(block_hash(1), make_payload(1), sync_remote=True)\n"
        "reader = TieredKVStore(make_codec(), HostMemoryTier(1 << 20), make_redis_tier(url))\n"
        "assert reader.get_blocks([block_hash(0), block_hash(1)]) == [make_payload(0), make_payload(1)]\n"
        "import redis; client = redis.Redis.from_url(url); key = writer.remote.key(block_hash(1))\n"
        "client.set(key, tampered_payload(client.get(key)))\n"
        "fresh = TieredKVStore(make_codec(), HostMemoryTier(1 << 20), make_redis_tier(url))\n"
        "assert fresh.get_blocks([block_hash(0), block_hash(1)]) == [make_payload(0)]\n"
        "print(dict(fresh.stats.rejected))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=_REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{('redis', 'mac'): 1}"
