"""The REST API end to end with the official OpenAI SDK: gateway + two
engine pods as real processes on loopback."""

from __future__ import annotations

import math
import re
import time

import httpx
import openai
import pytest

from engine_pod import SamplingParams
from tests.gateway.observe import aborted, in_flight
from tests.gateway.conftest import KEYS, MAX_MODEL_LEN, MODEL_NAME, client

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores the KV cache in",
    "def fibonacci(n):",
]


def _offline_text(llm, prompt, max_tokens: int) -> str:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return out[0].outputs[0].text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_offline_llm(platform, offline_llm, prompt):
    c = client(platform)
    r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == _offline_text(offline_llm, prompt, 20)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20
    assert r.usage.prompt_tokens == len(offline_llm.get_tokenizer().encode(prompt))


def test_streamed_completion_equals_unary(platform):
    c = client(platform)
    unary = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                 extra_body={"ignore_eos": True})
    chunks = list(c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == unary.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_greedy_equals_offline_llm_with_the_chat_template(platform, offline_llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    tok = offline_llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    expected = offline_llm.generate({"prompt_token_ids": ids},
                                    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    c = client(platform)
    r = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(ids)
    stream = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected.outputs[0].text


def test_n_choices_greedy_and_seeded(platform, offline_llm):
    c = client(platform)
    greedy = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], n=2, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in greedy.choices) == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text == _offline_text(offline_llm, PROMPTS[1], 12)
    assert greedy.usage.completion_tokens == 24

    def sample():
        r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], n=2, max_tokens=12, temperature=1.0,
                                 seed=7, extra_body={"ignore_eos": True})
        return [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]

    first, again = sample(), sample()
    assert first == again  # seeded: reproducible
    assert first[0] != first[1]  # each choice has its own seed


def test_stop_string_truncates_unary_and_streamed(platform, offline_llm):
    full = _offline_text(offline_llm, PROMPTS[0], 24)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), "pick a non-blank stop string"
    expected = full[: full.index(stop)]
    c = client(platform)
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                       stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_completions_and_chat(platform):
    c = client(platform)
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    # Special tokens (the random model emits some) are in the logprobs, not the text.
    assert "".join(t for t in lp.tokens if not t.startswith("<|")) == r.choices[0].text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 3
        # Greedy: the sampled token is the most likely one.
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)
    chat = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                     temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_usage_reports_cached_tokens(platform):
    c = client(platform)
    prompt = " ".join(f"word{i}" for i in range(60))  # several full 16-token blocks
    first = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    second = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The router sends the repeat to the pod that holds the prefix: every full block but the last token's.
    assert cached == (first.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_tenants_do_not_share_cached_prefixes(platform):
    prompt = " ".join(f"isolated{i}" for i in range(50))
    a = client(platform, "alice").completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    a2 = client(platform, "alice").completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    b = client(platform, "bob").completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert a2.usage.prompt_tokens_details.cached_tokens > 0
    assert b.usage.prompt_tokens_details.cached_tokens == 0
    assert b.choices[0].text == a.choices[0].text


def test_tenants_of_one_salt_group_share_cached_prefixes(platform):
    prompt = " ".join(f"groupdoc{i}" for i in range(50))
    a = client(platform, "docs-a").completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    b = client(platform, "docs-b").completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens == (a.usage.prompt_tokens - 1) // 16 * 16


def test_models_lists_the_served_model(platform):
    models = client(platform).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_missing_or_wrong_key_is_401(platform):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=platform.base_url + "/v1", api_key="sk-wrong", max_retries=0).completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=1)
    r = httpx.post(platform.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(platform.base_url + "/v1/models").status_code == 401


def test_requests_per_minute_limit_is_429_with_retry_after(platform):
    c = client(platform, "rpm")
    for _ in range(2):
        c.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        c.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    assert err.value.body["code"] == "requests_per_minute"
    wait = float(re.search(r"retry after ([0-9.]+) s", err.value.body["message"]).group(1))
    assert int(err.value.response.headers["retry-after"]) == max(1, math.ceil(wait)) <= 60


def test_tokens_per_minute_limit_is_429_with_retry_after(platform):
    c = client(platform, "tpm")
    prompt = " ".join(["token"] * 40)  # about 40 of the tenant's 60 tokens/min
    c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4)
    with pytest.raises(openai.RateLimitError) as err:
        c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4)
    assert err.value.body["code"] == "tokens_per_minute"
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_unknown_model_is_404(platform):
    with pytest.raises(openai.NotFoundError) as err:
        client(platform).completions.create(model="gpt-17", prompt="hi", max_tokens=1)
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x " * (MAX_MODEL_LEN + 10)}, "prompt"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": "hi", "temperature": 5}, "temperature"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    # Strict JSON types, as OpenAI: true is not 1, "16" not 16.
    ({"prompt": "hi", "n": True}, "n"),
    ({"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "logprobs": 9}, "logprobs"),
    ({"prompt": "hi", "bogus_field": 1}, "bogus_field"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({}, "prompt"),
])
def test_bad_input_is_400_in_openai_shape(platform, body, param):
    r = httpx.post(platform.base_url + "/v1/completions", json={"model": MODEL_NAME, **body},
                   headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_malformed_json_is_400(platform):
    r = httpx.post(platform.base_url + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                   headers={"Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]


def test_openapi_health_and_metrics(platform):
    doc = httpx.get(platform.base_url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(doc["paths"])
    assert httpx.get(platform.base_url + "/health").json()["pods"] == 2
    # Metrics name every tenant: never on the public port, only on their own.
    public = httpx.get(platform.base_url + "/metrics")
    assert public.status_code == 404 and public.json()["error"]["code"] == "not_found"
    assert "/metrics" not in doc["paths"]
    assert platform.metrics_port not in (platform.http_port, platform.grpc_port)
    metrics = httpx.get(platform.metrics_url).text
    assert 'tessera_gateway_requests_total{endpoint="completions",outcome="ok",priority_class="standard",' \
           'tenant="alice"}' in metrics
    assert "tessera_gateway_time_to_first_token_seconds_bucket" in metrics


@pytest.fixture(scope="module")
def one_at_a_time(tiny_llama, tmp_path_factory):
    """A pod that runs one sequence at a time behind its own gateway: 8
    choices of 200 tokens take seconds however fast the machine is."""
    from engine_pod.server.process import EnginePodProcess
    from gateway.process import GatewayProcess
    from tests.gateway.conftest import POD_ARGS, gateway_config

    work = tmp_path_factory.mktemp("one-at-a-time")
    with EnginePodProcess(tiny_llama, POD_ARGS + ["--max-num-seqs", "1"], log_path=work / "pod.log") as pod:
        pod.wait_serving()
        with GatewayProcess(gateway_config(tiny_llama, [(pod, "mixed")]), work, log_path=work / "gw.log") as gw:
            gw.wait_ready()
            yield gw, pod


def test_client_disconnect_aborts_the_engine_request(one_at_a_time):
    gw, pod = one_at_a_time
    before = aborted(pod)
    body = {"model": MODEL_NAME, "prompt": "a long answer please", "max_tokens": 200, "n": 8, "ignore_eos": True}
    # Not streamed: the client gives up waiting for the answer.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and in_flight(pod) > 0:
        time.sleep(0.05)
    assert in_flight(pod) == 0
    # One choice at a time: at most the first could have finished in 0.3 s.
    assert aborted(pod) >= before + 7
    # Streamed: the client reads a little and hangs up.
    before = aborted(pod)
    with httpx.stream("POST", gw.base_url + "/v1/completions", json={**body, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and in_flight(pod) > 0:
        time.sleep(0.05)
    assert in_flight(pod) == 0
    assert aborted(pod) >= before + 7
