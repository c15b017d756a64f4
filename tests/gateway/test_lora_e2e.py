"""LoRA adapters end to end: two real engine pods serving adapters
(`--enable-lora --lora-modules a0=... a1=... --lora-root DIR`) behind a real
gateway, driven with the OpenAI SDK and checked against the offline engine
on the same adapters (float64: greedy tokens equal whatever the batch)."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest

from engine_pod import SamplingParams
from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tests.gateway.conftest import KEYS, MAX_MODEL_LEN, MODEL_NAME, POD_ARGS, gateway_config, write_tenants
from tests.gateway.observe import metric_sum

LORA_KEYS = {"alice": KEYS["alice"], "ops": "sk-ops-lora-0123456789", "acme": "sk-acme-lora-0123456789"}
LORA_TENANTS = [
    {"name": "alice"},
    {"name": "ops", "admin": True},
    {"name": "acme", "allowed_models": ["a0"]},
]
PROMPT = "Hello, my name is"
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_root(tiny_llama_loras, tmp_path_factory):
    """The pods' --lora-root: a copy of tiny_llama_loras[2] as `a2`, loadable at run time."""
    root = tmp_path_factory.mktemp("adapters")
    shutil.copytree(tiny_llama_loras[2], root / "a2")
    return root


@pytest.fixture(scope="module")
def lora_platform(tiny_llama, tiny_llama_loras, adapter_root, tmp_path_factory):
    """Pods serving a0 and a1 from their flags, a2 loadable at run time from
    their --lora-root; a gateway whose config lists a0 and a1, with an admin
    tenant and one limited to a0."""
    work, root = tmp_path_factory.mktemp("lora"), adapter_root
    lora_args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-root", str(root),
                 "--lora-modules", f"a0={tiny_llama_loras[0]}", f"a1={tiny_llama_loras[1]}"]
    with EnginePodProcess(tiny_llama, POD_ARGS + lora_args, log_path=work / "a.log") as a, \
            EnginePodProcess(tiny_llama, POD_ARGS + lora_args, log_path=work / "b.log") as b:
        a.wait_serving()
        b.wait_serving()
        config = gateway_config(tiny_llama, [(a, "mixed"), (b, "mixed")],
                                write_tenants(work / "tenants.yaml", LORA_TENANTS, LORA_KEYS))
        config["model"]["loras"] = [{"name": "a0"}, {"name": "a1"}]
        with GatewayProcess(config, work, log_path=work / "gateway.log") as gw:
            gw.wait_ready(num_pods=2)
            yield gw


@pytest.fixture(scope="module")
def lora_llm(tiny_llama):
    """The offline engine with the pods' settings and LoRA on: the oracle."""
    from engine_pod import LLM

    return LLM(str(tiny_llama), dtype="float64", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=32 << 20,
               enable_lora=True, max_loras=2, max_lora_rank=16)


def _offline(llm, prompt, adapter_path=None, lora_int_id: int = 1) -> str:
    from engine_pod.lora_request import LoRARequest

    lora = LoRARequest(f"adapter-{lora_int_id}", lora_int_id, str(adapter_path)) if adapter_path else None
    return llm.generate(prompt, GREEDY, lora_request=lora)[0].outputs[0].text


def _client(gw, tenant: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=LORA_KEYS[tenant], max_retries=0)


def _complete(gw, model: str, tenant: str = "alice") -> str:
    r = _client(gw, tenant).completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert r.model == model
    return r.choices[0].text


def test_completions_and_chat_on_an_adapter_equal_the_offline_engine(lora_platform, lora_llm, tiny_llama_loras):
    base = _complete(lora_platform, MODEL_NAME)
    assert base == _offline(lora_llm, PROMPT)
    for index, name in enumerate(("a0", "a1")):
        expected = _offline(lora_llm, PROMPT, tiny_llama_loras[index], index + 1)
        assert _complete(lora_platform, name) == expected != base, name
    # Chat, streamed, on a0: the base model's chat template, the adapter's weights.
    messages = [{"role": "user", "content": "Name a fruit."}]
    tok = lora_llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    expected = _offline(lora_llm, {"prompt_token_ids": ids}, tiny_llama_loras[0], 1)
    stream = _client(lora_platform).chat.completions.create(model="a0", messages=messages, max_tokens=MAX_TOKENS,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == expected
    assert metric_sum(lora_platform.metrics_url, "tessera_gateway_model_requests_total", model="a0",
                      outcome="ok") >= 2


def test_models_lists_the_adapters_with_their_parent(lora_platform):
    models = {m.id: m for m in _client(lora_platform).models.list().data}
    assert set(models) == {MODEL_NAME, "a0", "a1"}
    assert models["a0"].parent == MODEL_NAME and models["a0"].root == "a0"
    assert models[MODEL_NAME].parent is None
    assert _client(lora_platform).models.retrieve("a1").parent == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as err:
        _complete(lora_platform, "a9")
    assert err.value.body["code"] == "model_not_found"


def test_a_tenant_uses_and_sees_only_its_models(lora_platform):
    assert _complete(lora_platform, "a0", "acme") == _complete(lora_platform, "a0")
    assert [m.id for m in _client(lora_platform, "acme").models.list().data] == ["a0"]
    for model in ("a1", MODEL_NAME, "a9"):
        with pytest.raises(openai.NotFoundError) as err:
            _complete(lora_platform, model, "acme")
        assert err.value.body["message"] == f"The model `{model}` does not exist or you do not have access to it."


def _admin(gw, path: str, body: dict, tenant: str = "ops") -> httpx.Response:
    return httpx.post(gw.base_url + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {LORA_KEYS[tenant]}"})


def test_an_admin_loads_an_adapter_at_run_time_and_unloads_it(lora_platform, adapter_root, lora_llm,
                                                              tiny_llama_loras):
    gw, path = lora_platform, str(adapter_root / "a2")
    refused = _admin(gw, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": path}, tenant="alice")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    # The pods read adapters only from their --lora-root folders.
    outside = _admin(gw, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(tiny_llama_loras[2])})
    assert outside.status_code == 403 and outside.json()["error"]["code"] == "lora_path_not_allowed"
    loaded = _admin(gw, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": path})
    assert loaded.status_code == 200, loaded.text
    assert [p["ok"] for p in loaded.json()["pods"]] == [True, True]
    # At once: the next request is served, as the offline engine does on the adapter.
    assert _complete(gw, "a2") == _offline(lora_llm, PROMPT, tiny_llama_loras[2], 3)
    assert "a2" in {m.id for m in _client(gw).models.list().data}
    taken = _admin(gw, "/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": path})
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "lora_adapter_exists"
    unloaded = _admin(gw, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        _complete(gw, "a2")
    assert "a2" not in {m.id for m in _client(gw).models.list().data}
