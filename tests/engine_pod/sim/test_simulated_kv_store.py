"""Simulated engines with the real KV store (host tier, a real redis-server):
a prefill engine saves every full prompt block under the real chained block
hashes, signed; a decode engine finds them, loads them through the store's
checks and is charged the profile's per_kv_byte_s for the bytes; its tokens
stay the prompt's own (engine_pod/sim/tokens.py). The sleep is recorded,
not slept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_pod.config import create_engine_config
from engine_pod.engine.engine_core import EngineCore
from engine_pod.engine.kv_store_factory import build_kv_store
from engine_pod.executor.simulated import SimulatedExecutor
from engine_pod.processor import Processor
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams
from engine_pod.sim.kv_transfer import filler_payload
from engine_pod.sim.step_features import step_features
from engine_pod.sim.step_profile import StepTimeProfile
from engine_pod.sim.tokens import simulated_output
from kv_store.block_hash import hash_request_tokens
from kv_store.codec import HEADER_SIZE, CorruptBlockError
from tessera.text import load_eos_token_ids

BLOCK = 16
# 1 us per KV byte (a 64 KiB block of tiny: 65.5 ms) next to steps of 10 ms: the charge dominates the
# steps that move KV, and the sleeps (recorded, not slept) show whether it was made.
PROFILE = StepTimeProfile(base_s=0.01, per_prefill_token_s=1e-4, per_decode_seq_s=1e-3, per_context_token_s=0.0,
                          per_kv_byte_s=1e-6)
PROMPT = list(range(40, 140))  # 100 tokens: six full blocks are stored, the last four tokens are computed


class _Engine:
    """A simulated EngineCore, the sleeps it asked for and each step's (features, predicted seconds)."""

    def __init__(self, model, num_gpu_blocks: int = 64, **kwargs) -> None:
        self.config = create_engine_config(model, simulate=True, max_model_len=256, num_gpu_blocks=num_gpu_blocks,
                                           **kwargs)
        self.slept: list[float] = []
        self.executor = SimulatedExecutor(self.config, PROFILE, sleep=self.slept.append)
        self.core = EngineCore(self.config, executor=self.executor)
        self.steps: list = []
        self.core.step_observer = self._observe
        self._processor = Processor(self.config, tokenizer=None, eos_token_ids=load_eos_token_ids(model))

    def _observe(self, output, seconds) -> None:
        features = step_features(output, self.executor.kv_bytes_per_block())
        self.steps.append((features, PROFILE.predict(features)))

    def run(self, prompt: list[int], max_tokens: int, produce: bool = False) -> tuple[list[int], int]:
        """The request's output tokens and its cached prompt tokens."""
        params = self._processor.process_params(SamplingParams(temperature=0.0, max_tokens=max_tokens))
        self.core.add_request(Request(f"r{len(self.steps)}", prompt, params,
                                      kv_transfer_mode="produce" if produce else None))
        tokens, cached = [], 0
        while self.core.has_unfinished_requests():
            for out in self.core.step():
                tokens += out.new_token_ids
                cached = max(cached, out.num_cached_tokens)
        return tokens, cached


def _expected(model, prompt, n) -> list[int]:
    return simulated_output(prompt, n, 8192, load_eos_token_ids(model))


def test_a_decode_engine_loads_the_prompt_a_prefill_engine_saved(tiny_llama, redis_server):
    prefill = _Engine(tiny_llama, kv_redis_url=redis_server.url)
    first, _ = prefill.run(PROMPT, 1, produce=True)
    store = prefill.core.kv_store
    hashes = hash_request_tokens(PROMPT, BLOCK)[:(len(PROMPT) - 1) // BLOCK]
    # Saved before the step returned (produce), under the real keys, signed, each its block's filler.
    payload_bytes = prefill.executor.kv_bytes_per_block()
    assert store.codec.layout.payload_bytes == payload_bytes
    for h in hashes:
        assert store.codec.decode(h, redis_server.client.get(store.remote.key(h))) == filler_payload(h, payload_bytes)
    decode = _Engine(tiny_llama, kv_redis_url=redis_server.url)
    tokens, cached = decode.run(PROMPT, 6)
    assert first == tokens[:1] and tokens == _expected(tiny_llama, PROMPT, 6)
    stats = decode.core.kv_store.stats
    assert cached == len(hashes) * BLOCK == decode.core.totals.external_prefix_hits
    assert stats.redis_hits == len(hashes) and stats.rejected_values == 0
    assert stats.bytes_read_redis == len(hashes) * (HEADER_SIZE + payload_bytes)


def test_each_step_is_charged_for_the_kv_bytes_it_moves(tiny_llama, redis_server):
    prefill = _Engine(tiny_llama, kv_redis_url=redis_server.url)
    prefill.run(PROMPT, 1, produce=True)
    block_bytes = prefill.executor.kv_bytes_per_block()
    (saved, predicted), = prefill.steps
    assert saved.kv_bytes_moved == 6 * block_bytes  # six blocks saved, one prefill step
    assert predicted == pytest.approx(0.01 + 100 * 1e-4 + 6 * block_bytes * 1e-6)
    decode = _Engine(tiny_llama, kv_redis_url=redis_server.url)
    decode.run(PROMPT, 3)
    loaded = decode.steps[0][0]
    assert loaded.kv_bytes_moved == 6 * block_bytes and loaded.num_prefill_tokens == 4
    assert loaded.num_context_tokens == 6 * BLOCK  # the loaded blocks are attended to
    # The store's work is done within the step: the sleep is what the prediction leaves of it
    # (the six blocks' charge is 0.39 s; their work here takes milliseconds).
    for (_, predicted), slept in zip(prefill.steps + decode.steps, prefill.slept + decode.slept):
        assert 0.0 <= predicted - slept < 0.05


def test_a_tampered_value_is_refused_and_the_prompt_recomputed(tiny_llama, redis_server):
    prefill = _Engine(tiny_llama, kv_redis_url=redis_server.url)
    prefill.run(PROMPT, 1, produce=True)
    store = prefill.core.kv_store
    third = store.remote.key(hash_request_tokens(PROMPT, BLOCK)[2])
    value = bytearray(redis_server.client.get(third))
    value[HEADER_SIZE + 7] ^= 0x01
    redis_server.client.set(third, bytes(value))
    decode = _Engine(tiny_llama, kv_redis_url=redis_server.url)
    tokens, cached = decode.run(PROMPT, 4)
    assert tokens == _expected(tiny_llama, PROMPT, 4)
    assert cached == 2 * BLOCK  # the run stops at the refused block
    assert dict(decode.core.kv_store.stats.rejected) == {("redis", "mac"): 1}
    decode.core.kv_store.flush()  # the decode engine saved the blocks it recomputed: genuine again
    decode.core.kv_store.codec.decode(hash_request_tokens(PROMPT, BLOCK)[2], redis_server.client.get(third))


def test_blocks_evicted_from_the_pool_come_back_from_the_host_tier(tiny_llama):
    """A pool of 20 blocks: the prompt's seven, then two 150-token prompts of ten each; the second
    evicts the prompt's blocks, which are offloaded to the host tier (emptied first, so what it
    holds next can only come from the offload)."""
    engine = _Engine(tiny_llama, num_gpu_blocks=20, kv_host_bytes=8 << 20)
    first, _ = engine.run(PROMPT, 3)
    store = engine.core.kv_store
    for h in store.host.lru_order():
        store.host.delete(h)
    for i in range(2):
        engine.run(list(range(3000 + 200 * i, 3150 + 200 * i)), 3)
    hashes = hash_request_tokens(PROMPT, BLOCK)
    assert engine.core.num_cached_prefix_blocks(hashes) == 0  # gone from the pool
    assert store.host.num_leading_hits(hashes) == 6  # offloaded when evicted
    again, cached = engine.run(PROMPT, 3)
    assert again == first == _expected(tiny_llama, PROMPT, 3)
    assert cached == 6 * BLOCK and store.stats.host_hits == 6


def test_simulated_blocks_never_meet_a_real_engines(tiny_llama, redis_server):
    """Filler is no KV: a simulated engine's blocks live under their own
    fingerprint, so a real engine neither fetches them (other keys) nor
    accepts one copied under its keys (the header names the fingerprint)."""
    simulated = build_kv_store(create_engine_config(tiny_llama, simulate=True, kv_redis_url=redis_server.url))
    real = build_kv_store(create_engine_config(tiny_llama, kv_redis_url=redis_server.url, device="cpu"))
    try:
        assert simulated.codec.layout.dtype == real.codec.layout.dtype == "float32"
        assert simulated.codec.layout.fingerprint != real.codec.layout.fingerprint
        assert simulated.remote.namespace != real.remote.namespace
        h = hash_request_tokens(PROMPT, BLOCK)[0]
        value = simulated.codec.sign(simulated.codec.encode(h, filler_payload(h, simulated.codec.layout.payload_bytes)))
        with pytest.raises(CorruptBlockError) as info:
            real.codec.decode(h, value)
        assert info.value.reason == "misaddressed"
    finally:
        simulated.close()
        real.close()


def test_a_simulated_engine_with_a_store_imports_no_torch(tiny_llama, redis_server):
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from engine_pod.config import create_engine_config\n"
        "from engine_pod.engine.engine_core import EngineCore\n"
        "from engine_pod.executor.simulated import SimulatedExecutor\n"
        "from engine_pod.request import Request\n"
        "from engine_pod.sampling_params import SamplingParams\n"
        "from engine_pod.sim.step_profile import StepTimeProfile\n"
        f"config = create_engine_config({str(tiny_llama)!r}, simulate=True, num_gpu_blocks=16, max_model_len=64,\n"
        f"                              kv_host_bytes=1 << 20, kv_redis_url={redis_server.url!r})\n"
        "core = EngineCore(config, SimulatedExecutor(config, StepTimeProfile(0.0, 0.0, 0.0, 0.0)))\n"
        "params = SamplingParams(temperature=0.0, max_tokens=1)\n"
        "core.add_request(Request('r', list(range(50)), params, kv_transfer_mode='produce'))\n"
        "while core.has_unfinished_requests():\n"
        "    core.step()\n"
        "print(len(core.kv_store.host), core.kv_store.stats.bytes_written_redis > 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "True"]


def test_a_failed_start_leaves_no_store_behind(tiny_llama, redis_server, monkeypatch):
    """A start that fails after the store is built closes it: no write-behind thread or Redis
    connection outlives the engine that never ran."""
    import threading

    import engine_pod.engine.engine_core as engine_core

    def refuse(*args, **kwargs):
        raise RuntimeError("scheduler refused")

    monkeypatch.setattr(engine_core, "Scheduler", refuse)
    config = create_engine_config(tiny_llama, simulate=True, max_model_len=256, num_gpu_blocks=64,
                                  kv_redis_url=redis_server.url)
    before = {t.ident for t in threading.enumerate() if t.name == "kv-write-behind"}
    with pytest.raises(RuntimeError, match="scheduler refused"):
        EngineCore(config, executor=SimulatedExecutor(config, PROFILE, sleep=lambda s: None))
    assert {t.ident for t in threading.enumerate() if t.name == "kv-write-behind"} == before
