"""P/D through the gateway: a prefill pod and a decode pod sharing a real
Redis; long uncached prompts are prefilled on the prefill pod and decoded
on the decode pod, which loads the prompt's KV from the store."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from engine_pod import SamplingParams
from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tests.engine_pod.server.client import scrape_metrics
from tests.gateway.observe import aborted, in_flight
from tests.gateway.conftest import MODEL_NAME, POD_ARGS, gateway_config

BLOCK = 16
THRESHOLD = 48


def _pd_platform(model, work, decode_args: list[str], disaggregation: dict):
    """A prefill pod and a decode pod sharing a Redis, behind a gateway."""
    from kv_store.local_redis import RedisServer

    redis = RedisServer(work)
    redis_args = ["--kv-redis-url", redis.url]
    try:
        with EnginePodProcess(model, POD_ARGS + redis_args + ["--role", "prefill"],
                              log_path=work / "prefill.log") as prefill, \
             EnginePodProcess(model, POD_ARGS + redis_args + ["--role", "decode", *decode_args],
                              log_path=work / "decode.log") as decode:
            prefill.wait_serving()
            decode.wait_serving()
            config = gateway_config(model, [(prefill, "prefill"), (decode, "decode")], disaggregation=disaggregation)
            with GatewayProcess(config, work, log_path=work / "gateway.log") as gw:
                gw.wait_ready(num_pods=2)
                yield gw, prefill, decode
    finally:
        redis.stop()


@pytest.fixture(scope="module")
def pd_platform(tiny_llama, tmp_path_factory):
    # The decode pod runs one sequence at a time, so a request of 8 choices
    # lasts seconds and the cancellation test cannot race its end.
    yield from _pd_platform(tiny_llama, tmp_path_factory.mktemp("pd"), ["--max-num-seqs", "1"],
                            {"min_uncached_tokens": THRESHOLD})


def _routing(gw) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(gw.metrics_url).text.splitlines():
        if line.startswith("tessera_gateway_routing_decisions_total{"):
            labels, value = line.split("} ")
            fields = dict(kv.split("=") for kv in labels.split("{")[1].split(","))
            key = (fields["role"].strip('"'), fields["kind"].strip('"'))
            out[key] = out.get(key, 0) + float(value)
    return out


def _complete(gw, prompt: str, max_tokens: int = 12, **extra) -> dict:
    r = httpx.post(gw.base_url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_long_prompts_are_disaggregated_and_match_the_offline_engine(pd_platform, offline_llm):
    gw, _, _ = pd_platform
    long_prompt = " ".join(f"segment{i} of the shared document" for i in range(20))
    short_prompt = "A short question"
    before = _routing(gw)
    long_out = _complete(gw, long_prompt)
    after_long = _routing(gw)
    short_out = _complete(gw, short_prompt)
    after_short = _routing(gw)

    def delta(a, b, key):
        return b.get(key, 0) - a.get(key, 0)

    assert delta(before, after_long, ("prefill", "prefill")) == 1
    assert delta(before, after_long, ("decode", "decode")) == 1
    # Short prompt: below the threshold, the decode pod computes it alone.
    assert delta(after_long, after_short, ("prefill", "prefill")) == 0
    assert delta(after_long, after_short, ("decode", "route")) == 1

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt, out in ((long_prompt, long_out), (short_prompt, short_out)):
        assert out["choices"][0]["text"] == offline_llm.generate(prompt, params)[0].outputs[0].text
    # The decode pod loaded every full block of the long prompt from Redis.
    prompt_tokens = long_out["usage"]["prompt_tokens"]
    assert prompt_tokens >= THRESHOLD
    assert long_out["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // BLOCK * BLOCK


def test_a_guided_request_is_disaggregated_and_follows_its_grammar(pd_platform, offline_llm):
    """The decode pod samples every output token under the grammar (the
    prefill pod's token is discarded): the text equals the offline engine's
    guided output."""
    from tessera.structured_output import StructuredOutputsParams

    gw, _, _ = pd_platform
    prompt = " ".join(f"clause{i} of the guided document" for i in range(20))
    pattern = r"(red|green|blue)-[0-9]{2}"
    before = _routing(gw)
    out = _complete(gw, prompt, max_tokens=16, ignore_eos=False, structured_outputs={"regex": pattern})
    assert _routing(gw).get(("prefill", "prefill"), 0) - before.get(("prefill", "prefill"), 0) == 1
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=pattern))
    assert out["choices"][0]["text"] == offline_llm.generate(prompt, params)[0].outputs[0].text
    assert out["choices"][0]["finish_reason"] == "stop"
    assert re.fullmatch(pattern, out["choices"][0]["text"])


def test_a_cancelled_stream_is_aborted_on_every_pod(pd_platform):
    gw, prefill, decode = pd_platform
    aborted_before = aborted(decode)
    prompt = " ".join(f"cancel{i} me early please" for i in range(20))
    with httpx.stream("POST", gw.base_url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 120, "n": 8, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data:"))
        assert in_flight(decode) >= 1
    # The client went away: the decode pod's request is aborted, nothing stays behind.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and in_flight(decode) + in_flight(prefill) > 0:
        time.sleep(0.05)
    assert in_flight(decode) == 0 and in_flight(prefill) == 0
    # One choice at a time: at most the first finished before the client left.
    assert aborted(decode) >= aborted_before + 7


@pytest.fixture(scope="module")
def pd_direct_platform(tiny_llama, tmp_path_factory):
    """The gateway with ``kv_channel: direct``: the prefill pod pushes each
    prompt's blocks to the decode pod the gateway picked."""
    yield from _pd_platform(tiny_llama, tmp_path_factory.mktemp("pd-direct"), ["--kv-inbox-bytes", str(16 << 20)],
                            {"min_uncached_tokens": THRESHOLD, "kv_channel": "direct"})


def test_the_direct_channel_serves_the_decode_pod_and_matches_the_offline_engine(pd_direct_platform, offline_llm):
    gw, prefill, decode = pd_direct_platform
    prompt = " ".join(f"passage{i} of the pushed document" for i in range(20))
    before_p, before_d = scrape_metrics(prefill), scrape_metrics(decode)
    out = _complete(gw, prompt)
    after_p, after_d = scrape_metrics(prefill), scrape_metrics(decode)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert out["choices"][0]["text"] == offline_llm.generate(prompt, params)[0].outputs[0].text
    full_blocks = (out["usage"]["prompt_tokens"] - 1) // BLOCK
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks * BLOCK

    def grew(before, after, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew(before_p, after_p, "tessera_kv_transfer_pushes_total", outcome="ok") == 1
    assert grew(before_d, after_d, "tessera_kv_store_hits_total", tier="inbox") == full_blocks
    assert grew(before_d, after_d, "tessera_kv_store_hits_total", tier="redis") == 0
