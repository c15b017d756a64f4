"""LoRA adapters through the gateway's REST API, in one process: fake engine
pods (real gRPC servers on loopback answering the Engine API from a table)
behind a real `Gateway` and its FastAPI app (httpx over ASGI, no sockets for
REST). What they check: the admin endpoints' authorization, fan-out, status
mapping and per-pod results; `lora_name` reaching the engine; the block
hashes of an adapter request carrying its fingerprint; /v1/models per
tenant; the requests-per-model metric. tests/gateway/test_lora_e2e.py does
the same with real engine pods."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import httpx
import pytest

from gateway.config import gateway_config_from_dict
from gateway.grpc_service import InferenceService
from gateway.grpc_service import add_to_server as add_inference_service
from gateway.model import ServedModel
from gateway.openai_api.server import build_app
from gateway.pods import Pod
from gateway.priority import PriorityClasses
from gateway.serving import Gateway
from gateway.tenants import TenantRegistry, hash_api_key
from kv_store.block_hash import hash_request_tokens
from tessera.internal_secret import InternalSecret
from tessera.v1 import engine_pb2 as epb
from tessera.v1 import engine_pb2_grpc as epb_grpc
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc

MODEL = "tiny"
SECRET = InternalSecret.from_text("lora-gateway-tests-internal-secret-0123")
KEYS = {"ops": "sk-ops-0123456789", "acme": "sk-acme-0123456789", "beta": "sk-beta-0123456789"}
TENANTS = {"tenants": [
    {"name": "ops", "api_key_sha256": hash_api_key(KEYS["ops"]), "admin": True},
    {"name": "acme", "api_key_sha256": hash_api_key(KEYS["acme"]), "allowed_models": ["sql-lora"]},
    {"name": "beta", "api_key_sha256": hash_api_key(KEYS["beta"])},
]}
FINGERPRINT = "ab" * 32
# The fake pod's output token for the base model and for any adapter.
BASE_TOKEN, ADAPTER_TOKEN = 100, 200


class FakePod(epb_grpc.EngineServicer):
    """An Engine that serves adapters from a table and records what it was asked."""

    def __init__(self, adapters: dict[str, bool] | None = None) -> None:
        self.adapters = dict(adapters or {})  # name -> resident
        # Set by a test: how LoadLoRAAdapter / UnloadLoRAAdapter answer (None: as asked).
        self.refuse: grpc.StatusCode | None = None
        self.hang = False
        self.generated: list[epb.GenerateRequest] = []
        self.prefix_queries: list[list[bytes]] = []

    def report(self) -> epb.LoadReport:
        return epb.LoadReport(role="mixed", serving=True, lora_adapters=self._list())

    def _list(self) -> list[epb.LoRAAdapter]:
        return [epb.LoRAAdapter(name=n, fingerprint=FINGERPRINT, resident=r) for n, r in sorted(self.adapters.items())]

    async def _admin(self, context) -> None:
        if self.hang:
            await asyncio.Event().wait()
        if self.refuse is not None:
            await context.abort(self.refuse, f"refused ({self.refuse.name}) by the fake pod")

    async def LoadLoRAAdapter(self, request, context):
        await self._admin(context)
        self.adapters[request.lora_name] = False
        return epb.LoRAAdapterList(adapters=self._list())

    async def UnloadLoRAAdapter(self, request, context):
        await self._admin(context)
        if self.adapters.pop(request.lora_name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.lora_name!r} is not served")
        return epb.LoRAAdapterList(adapters=self._list())

    async def GetLoad(self, request, context):
        self.prefix_queries.append(list(request.block_hashes))
        return self.report()

    async def Generate(self, request, context):
        self.generated.append(request)
        if request.lora_name and request.lora_name not in self.adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.lora_name!r} is not served")
        token = ADAPTER_TOKEN if request.lora_name else BASE_TOKEN
        yield epb.GenerateResponse(request_id=request.request_id, token_ids=[token], finish_reason="length",
                                   num_prompt_tokens=len(request.prompt_token_ids))


@pytest.fixture(scope="module")
def served_model(tiny_llama) -> ServedModel:
    config = gateway_config_from_dict({"model": {"name": MODEL, "path": str(tiny_llama)},
                                       "pods": {"static": [{"address": "127.0.0.1:1"}]}})
    return ServedModel.load(config.model)


class Platform:
    """Fake pods behind a Gateway and its app, inside one event loop."""

    def __init__(self, gateway: Gateway, fakes: list[FakePod], pods: list[Pod]) -> None:
        self.gateway = gateway
        self.fakes = fakes
        self.pods = pods
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gateway)), base_url="http://gw",
                                      timeout=30)

    def report(self) -> None:
        """Each pod's load report, as its StreamLoad would push it."""
        for fake, pod in zip(self.fakes, self.pods):
            pod.on_report(fake.report())

    async def post(self, path: str, body: dict, tenant: str | None = "ops") -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
        return await self.http.post(path, json=body, headers=headers)

    async def get(self, path: str, tenant: str = "beta") -> httpx.Response:
        return await self.http.get(path, headers={"Authorization": f"Bearer {KEYS[tenant]}"})


@contextlib.asynccontextmanager
async def platform(served_model: ServedModel, fakes: list[FakePod], tenants: dict | None = TENANTS, **model):
    servers, pods = [], []
    for fake in fakes:
        server = grpc.aio.server()
        epb_grpc.add_EngineServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        pods.append(Pod(f"127.0.0.1:{port}", "mixed"))
    config = gateway_config_from_dict({
        "model": {"name": MODEL, "path": "unused", "lora_admin_timeout_s": 1.0, **model},
        "pods": {"static": [{"address": p.address} for p in pods]},
        "router": {"prefix_query_timeout_ms": 5000}})
    registry = TenantRegistry.from_dict(tenants, SECRET) if tenants else TenantRegistry.open_access(SECRET)
    gateway = Gateway(config, served_model, registry, PriorityClasses.from_config(None, None))
    for pod in pods:
        gateway.pool.pods[pod.address] = pod
    p = Platform(gateway, fakes, pods)
    p.report()
    try:
        yield p
    finally:
        await p.http.aclose()
        await gateway.close()
        for server in servers:
            await server.stop(None)


def run(served_model, fakes, scenario, **kwargs):
    async def main():
        async with platform(served_model, fakes, **kwargs) as p:
            return await scenario(p)
    return asyncio.run(main())


# -- admin endpoints: who may call them -----------------------------------


def test_admin_endpoints_need_an_admin_key(served_model):
    async def scenario(p: Platform):
        body = {"lora_name": "new-lora", "lora_path": "/adapters/new"}
        missing = await p.post("/v1/load_lora_adapter", body, tenant=None)
        refused = await p.post("/v1/load_lora_adapter", body, tenant="beta")
        # Refused before the body is read: a non-admin learns nothing of the endpoint's body.
        malformed = await p.http.post("/v1/unload_lora_adapter", content=b"{not json",
                                      headers={"Authorization": f"Bearer {KEYS['acme']}"})
        return missing, refused, malformed, [f.adapters for f in p.fakes]

    missing, refused, malformed, adapters = run(served_model, [FakePod()], scenario)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    for r in (refused, malformed):
        assert r.status_code == 403, r.text
        assert r.json()["error"] == {"message": "this API key may not call admin endpoints (its tenant lacks "
                                                "`admin: true`)", "type": "permission_error", "param": None,
                                     "code": "permission_denied"}
    assert adapters == [{}]  # no pod was asked
    assert KEYS["beta"] not in refused.text


def test_without_a_tenants_file_the_admin_endpoints_are_always_refused(served_model):
    async def scenario(p: Platform):
        return await p.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x"})

    r = run(served_model, [FakePod()], scenario, tenants=None)
    assert r.status_code == 403 and "admin API key" in r.json()["error"]["message"]
    assert "tenants file" in r.json()["error"]["message"]


# -- admin endpoints: what they do ----------------------------------------


def test_a_load_reaches_every_pod_and_the_adapter_serves_at_once(served_model):
    async def scenario(p: Platform):
        before = await p.post("/v1/completions", {"model": "new-lora", "prompt": "hi", "max_tokens": 1}, "beta")
        loaded = await p.post("/v1/load_lora_adapter", {"lora_name": "new-lora", "lora_path": "/adapters/new"})
        # No load report since: the gateway's own list and the pods' answers route it.
        served = await p.post("/v1/completions", {"model": "new-lora", "prompt": "hi", "max_tokens": 1}, "beta")
        listed = await p.get("/v1/models")
        unloaded = await p.post("/v1/unload_lora_adapter", {"lora_name": "new-lora"})
        after = await p.post("/v1/completions", {"model": "new-lora", "prompt": "hi", "max_tokens": 1}, "beta")
        again = await p.post("/v1/unload_lora_adapter", {"lora_name": "new-lora"})
        return before, loaded, served, listed, unloaded, after, again

    fakes = [FakePod(), FakePod()]
    before, loaded, served, listed, unloaded, after, again = run(served_model, fakes, scenario)
    assert before.status_code == 404 and before.json()["error"]["code"] == "model_not_found"
    assert loaded.status_code == 200, loaded.text
    body = loaded.json()
    assert body["lora_name"] == "new-lora" and body["message"] == \
        "Success: LoRA adapter 'new-lora' added successfully."
    assert [pod["ok"] for pod in body["pods"]] == [True, True]
    assert served.status_code == 200 and served.json()["model"] == "new-lora"
    assert {"id": "new-lora", "object": "model", "created": 0, "owned_by": "tessera", "root": "new-lora",
            "parent": MODEL, "max_model_len": served_model.max_model_len} in listed.json()["data"]
    assert unloaded.status_code == 200 and unloaded.json()["action"] == "unload"
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
    # Nobody serves it any more: an unload is 404, each pod's NOT_FOUND listed.
    assert again.status_code == 404 and again.json()["error"]["code"] == "lora_adapter_not_found"
    assert [pod["grpc_code"] for pod in again.json()["pods"]] == ["NOT_FOUND", "NOT_FOUND"]
    assert [f.adapters for f in fakes] == [{}, {}]


@pytest.mark.parametrize("code, status, error_code", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_lora_adapter"),
    (grpc.StatusCode.FAILED_PRECONDITION, 400, "lora_not_enabled"),
    (grpc.StatusCode.PERMISSION_DENIED, 403, "lora_path_not_allowed"),
    (grpc.StatusCode.ALREADY_EXISTS, 409, "lora_adapter_exists"),
    (grpc.StatusCode.UNAVAILABLE, 503, "engine_unavailable"),
    (grpc.StatusCode.INTERNAL, 502, "engine_error"),
])
def test_the_pods_refusal_maps_to_an_http_status(served_model, code, status, error_code):
    async def scenario(p: Platform):
        for fake in p.fakes:
            fake.refuse = code
        r = await p.post("/v1/load_lora_adapter", {"lora_name": "bad-lora", "lora_path": "/adapters/bad"})
        return r, p.gateway.catalog.known("bad-lora")

    r, known = run(served_model, [FakePod(), FakePod()], scenario)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["code"] == error_code
    assert f"refused ({code.name}) by the fake pod" in body["error"]["message"]
    assert [(pod["status"], pod["grpc_code"]) for pod in body["pods"]] == [(status, code.name)] * 2
    assert not known


def test_a_partial_load_says_which_pods_took_it_and_routes_to_those(served_model):
    async def scenario(p: Platform):
        p.fakes[1].refuse = grpc.StatusCode.INVALID_ARGUMENT
        r = await p.post("/v1/load_lora_adapter", {"lora_name": "half-lora", "lora_path": "/adapters/half"})
        served = [await p.post("/v1/completions", {"model": "half-lora", "prompt": [1, 2, 3], "max_tokens": 1},
                               "beta") for _ in range(4)]
        return r, served, [len(f.generated) for f in p.fakes]

    r, served, generated = run(served_model, [FakePod(), FakePod()], scenario)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"].startswith("load of LoRA adapter 'half-lora' failed on 1 of 2 engine pod(s) "
                                       "(succeeded on 1)")
    assert [pod["ok"] for pod in r.json()["pods"]] == [True, False]
    assert all(s.status_code == 200 for s in served)
    assert generated == [4, 0]  # only the pod serving it


def test_failures_that_disagree_are_502_and_a_silent_pod_times_out(served_model):
    async def scenario(p: Platform):
        p.fakes[0].refuse = grpc.StatusCode.PERMISSION_DENIED
        p.fakes[1].hang = True
        loop = asyncio.get_running_loop()
        start = loop.time()
        r = await p.post("/v1/load_lora_adapter", {"lora_name": "x-lora", "lora_path": "/adapters/x"})
        return r, loop.time() - start

    r, took = run(served_model, [FakePod(), FakePod()], scenario)
    assert r.status_code == 502 and r.json()["error"]["code"] == "lora_admin_partial"
    assert [(pod["status"], pod["grpc_code"]) for pod in r.json()["pods"]] == [
        (403, "PERMISSION_DENIED"), (504, "DEADLINE_EXCEEDED")]
    assert took < 3  # model.lora_admin_timeout_s is 1 s here


def test_an_unload_is_done_where_the_adapter_was_and_absent_elsewhere(served_model):
    async def scenario(p: Platform):
        r = await p.post("/v1/unload_lora_adapter", {"lora_name": "sql-lora"})
        return r, p.gateway.catalog.known("sql-lora")

    # A pod that joined after the adapter was loaded has nothing to unload: not a failure.
    r, known = run(served_model, [FakePod({"sql-lora": True}), FakePod()], scenario)
    assert r.status_code == 200, r.text
    assert [pod["grpc_code"] for pod in r.json()["pods"]] == ["OK", "NOT_FOUND"]
    assert not known


@pytest.mark.parametrize("body, param", [
    ({"lora_name": "tiny", "lora_path": "/a"}, "lora_name"),  # the base model's name
    ({"lora_name": "has space", "lora_path": "/a"}, "lora_name"),
    ({"lora_name": "x", "lora_path": ""}, "lora_path"),
    ({"lora_name": "x"}, "lora_path"),
    ({"lora_name": "x", "lora_path": "/a", "load_inplace": True}, "load_inplace"),
])
def test_bad_admin_bodies_are_400_naming_the_field(served_model, body, param):
    async def scenario(p: Platform):
        return await p.post("/v1/load_lora_adapter", body), p.fakes[0].adapters

    r, adapters = run(served_model, [FakePod()], scenario)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert adapters == {}


# -- requests on adapters -------------------------------------------------


def test_requests_on_an_adapter_carry_its_name_and_hash_with_its_fingerprint(served_model):
    prompt = list(range(10, 50))  # two full blocks of 16: the router asks for the prefix

    async def scenario(p: Platform):
        completion = await p.post("/v1/completions", {"model": "sql-lora", "prompt": prompt, "max_tokens": 1},
                                  "acme")
        chat = await p.post("/v1/chat/completions", {"model": "sql-lora", "max_tokens": 1, "stream": True,
                                                     "messages": [{"role": "user", "content": "hi"}]}, "acme")
        base = await p.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}, "beta")
        return completion, chat, base

    fake = FakePod({"sql-lora": True})
    completion, chat, base = run(served_model, [fake], scenario)
    assert completion.status_code == chat.status_code == base.status_code == 200
    assert completion.json()["choices"][0]["text"] == served_model.tokenizer.decode([ADAPTER_TOKEN])
    assert '"model":"sql-lora"' in chat.text and "data: [DONE]" in chat.text
    assert [g.lora_name for g in fake.generated] == ["sql-lora", "sql-lora", ""]
    acme_salt, beta_salt = fake.generated[0].cache_salt, fake.generated[2].cache_salt
    # The router hashed as the pod does: with the adapter's fingerprint (else no prefix ever matches).
    assert fake.prefix_queries[0] == hash_request_tokens(prompt, 16, acme_salt, adapter=FINGERPRINT)
    assert fake.prefix_queries[-1] == hash_request_tokens(prompt, 16, beta_salt)


def test_a_pod_not_serving_the_adapter_answers_404(served_model):
    """A configured adapter that no pod reports: routed to any pod, whose NOT_FOUND is the client's 404."""
    async def scenario(p: Platform):
        return await p.post("/v1/completions", {"model": "sql-lora", "prompt": "hi", "max_tokens": 1}, "acme")

    fake = FakePod()
    r = run(served_model, [fake], scenario, loras=[{"name": "sql-lora"}])
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "The model `sql-lora` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert [g.lora_name for g in fake.generated] == ["sql-lora"]


def test_each_tenant_sees_and_uses_only_its_models(served_model):
    async def scenario(p: Platform):
        acme = await p.get("/v1/models", "acme")
        beta = await p.get("/v1/models", "beta")
        one = await p.get("/v1/models/sql-lora", "acme")
        hidden = await p.get("/v1/models/chat-lora", "acme")
        base = await p.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}, "acme")
        other = await p.post("/v1/completions", {"model": "chat-lora", "prompt": "hi", "max_tokens": 1}, "acme")
        unknown = await p.post("/v1/completions", {"model": "nope-lora", "prompt": "hi", "max_tokens": 1}, "acme")
        return acme, beta, one, hidden, base, other, unknown

    fakes = [FakePod({"sql-lora": True, "chat-lora": False})]
    acme, beta, one, hidden, base, other, unknown = run(served_model, fakes, scenario)
    assert [m["id"] for m in acme.json()["data"]] == ["sql-lora"]
    assert [(m["id"], m["parent"]) for m in beta.json()["data"]] == [
        (MODEL, None), ("chat-lora", MODEL), ("sql-lora", MODEL)]
    assert one.json()["parent"] == MODEL
    for r, name in ((hidden, "chat-lora"), (base, MODEL), (other, "chat-lora"), (unknown, "nope-lora")):
        assert r.status_code == 404
        assert r.json()["error"]["message"] == f"The model `{name}` does not exist or you do not have access to it."
    assert fakes[0].generated == []


def test_requests_are_counted_per_model_with_bounded_labels(served_model):
    async def scenario(p: Platform):
        for model in ("sql-lora", MODEL, "made-up-1", "made-up-2"):
            await p.post("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1}, "beta")
        return p.gateway.metrics.registry

    registry = run(served_model, [FakePod({"sql-lora": True})], scenario)
    samples = {(s.labels["model"], s.labels["outcome"]): s.value
               for metric in registry.collect() if metric.name == "tessera_gateway_model_requests"
               for s in metric.samples if s.name.endswith("_total")}
    assert samples == {("sql-lora", "ok"): 1, (MODEL, "ok"): 1, ("(unknown)", "rejected"): 2}


def test_the_grpc_api_resolves_and_lists_models_the_same_way(served_model):
    """tessera.v1.Inference's `model` names an adapter as REST's does; ListModels
    lists what the key may use (ModelInfo has no parent field: the base comes first)."""
    async def scenario(p: Platform):
        server = grpc.aio.server()
        add_inference_service(InferenceService(p.gateway), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.InferenceStub(channel)

                def auth(tenant):
                    return (("authorization", f"Bearer {KEYS[tenant]}"),)

                listed = {t: [m.id for m in (await stub.ListModels(pb.ListModelsRequest(), metadata=auth(t))).models]
                          for t in ("acme", "beta")}
                params = pb.GenerationParams(max_tokens=1)
                ok = await stub.CompleteUnary(pb.CompletionRequest(model="sql-lora", prompt="hi", params=params),
                                              metadata=auth("acme"))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.CompleteUnary(pb.CompletionRequest(model="chat-lora", prompt="hi", params=params),
                                             metadata=auth("acme"))
                return listed, ok, refused.value
        finally:
            await server.stop(None)

    fake = FakePod({"sql-lora": True, "chat-lora": True})
    listed, ok, refused = run(served_model, [fake], scenario)
    assert listed == {"acme": ["sql-lora"], "beta": [MODEL, "chat-lora", "sql-lora"]}
    assert ok.model == "sql-lora" and [g.lora_name for g in fake.generated] == ["sql-lora"]
    assert refused.code() == grpc.StatusCode.NOT_FOUND
    assert refused.details() == "The model `chat-lora` does not exist or you do not have access to it."
