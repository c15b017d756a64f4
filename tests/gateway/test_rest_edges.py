"""The REST API's rough edges, in one process: a fake engine pod (a real gRPC server on
loopback that answers Generate with the tokens a test scripts) behind a real `Gateway` and its
FastAPI app (httpx over ASGI). What they check: GET /v1/models/{id}; OpenAI's error shape for
every error the server can answer (an unknown route, a wrong method, a bad body, a bug); a clear
400 for non-text chat content; completions' text_offset from the text itself; every refusal
counted once with its reason."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.openai_api import server
from gateway.rejections import count_rejection
from tessera.v1 import engine_pb2 as epb
from tests.gateway.test_lora_gateway import KEYS, MODEL, FakePod, Platform, run, served_model  # noqa: F401

EMOJI = "\N{GRINNING FACE}"  # four byte-level tokens: the first three decode to nothing yet
BOS, PAD, BAS = 0, 4, 1867  # <|begin_of_text|> (17 characters on its own), <|pad|>, "bas"


class ScriptedPod(FakePod):
    """Answers every Generate with `script`'s tokens and their logprobs, `per_response` tokens
    a response (as a pod streams several tokens a step)."""

    def __init__(self, script: list[int], per_response: int = 1) -> None:
        super().__init__()
        self.script = script
        self.per_response = per_response

    async def Generate(self, request, context):
        self.generated.append(request)
        for i in range(0, len(self.script), self.per_response):
            tokens = self.script[i:i + self.per_response]
            last = i + self.per_response >= len(self.script)
            logprobs = [epb.TokenLogprobs(entries=[epb.TokenLogprob(token_id=t, logprob=-0.5, rank=1)])
                        for t in tokens]
            yield epb.GenerateResponse(request_id=request.request_id, token_ids=tokens, logprobs=logprobs,
                                       finish_reason="length" if last else "",
                                       num_prompt_tokens=len(request.prompt_token_ids))


def _sse(text: str) -> list[dict]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _without_raising(p: Platform) -> httpx.AsyncClient:
    """A client of the same app that gets the 500 a server sends, as uvicorn's clients do (after
    the answer, Starlette re-raises a handled bug for the server to log: httpx would raise it)."""
    transport = httpx.ASGITransport(app=server.build_app(p.gateway), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://gw")


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# -- GET /v1/models/{id} ------------------------------------------------------


def test_retrieve_a_model_as_listed(served_model):
    async def scenario(p: Platform):
        listed = await p.get("/v1/models")
        return listed, [await p.get(f"/v1/models/{name}") for name in (MODEL, "sql-lora", "nope", "sql-lora/x")]

    listed, (base, adapter, unknown, nested) = run(served_model, [FakePod({"sql-lora": True})], scenario,
                                                   loras=[{"name": "sql-lora"}])
    by_id = {m["id"]: m for m in listed.json()["data"]}
    assert base.json() == by_id[MODEL] and adapter.json() == by_id["sql-lora"]
    assert {"id": MODEL, "object": "model", "owned_by": "tessera", "parent": None, "root": MODEL}.items() \
        <= base.json().items() and isinstance(base.json()["created"], int)
    assert (adapter.json()["parent"], adapter.json()["root"]) == (MODEL, "sql-lora")
    for r, name in ((unknown, "nope"), (nested, "sql-lora/x")):
        assert _error(r, 404) == {"message": f"The model `{name}` does not exist or you do not have access to it.",
                                  "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


# -- OpenAI's error shape everywhere ------------------------------------------


def test_every_error_is_openais_shape(served_model, monkeypatch):
    auth = {"Authorization": f"Bearer {KEYS['beta']}"}

    async def scenario(p: Platform):
        return {
            "unknown path": await p.http.get("/v2/nothing", headers=auth),
            "wrong method": await p.http.get("/v1/chat/completions", headers=auth),
            "wrong method, no key": await p.http.delete("/v1/models"),
            "not json": await p.http.post("/v1/completions", content=b"{nope",
                                          headers={**auth, "Content-Type": "application/json"}),
            "no content type": await p.http.post("/v1/completions", content=b'{"model": "tiny"}', headers=auth),
            "wrong types": await p.post("/v1/completions", {"model": MODEL, "prompt": 1.5}, "beta"),
            "a bug": await _without_raising(p).get("/v1/models", headers=auth),
        }

    def bug(*args):
        raise RuntimeError("a bug in the gateway")

    fake = FakePod()
    monkeypatch.setattr(server, "_model_json", bug)
    r = run(served_model, [fake], scenario)
    assert _error(r["unknown path"], 404) == {"message": "Not Found: GET /v2/nothing", "type": "invalid_request_error",
                                              "param": None, "code": "not_found"}
    assert _error(r["wrong method"], 405)["code"] == "method_not_allowed"
    assert r["wrong method"].headers["allow"] == "POST"
    assert _error(r["wrong method, no key"], 405)["message"] == "Method Not Allowed: DELETE /v1/models"
    assert r["wrong method, no key"].headers["allow"] == "GET"
    assert _error(r["not json"], 400)["message"].startswith("the body is not valid JSON")
    assert _error(r["no content type"], 400)["message"] == \
        "the body must be a JSON object, sent with Content-Type: application/json"
    assert _error(r["wrong types"], 400)["param"] == "prompt"
    assert _error(r["a bug"], 500) == {"message": "internal error", "type": "internal_error", "param": None,
                                       "code": "internal_error"}
    assert "RuntimeError" not in r["a bug"].text


# -- non-text chat content ----------------------------------------------------


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
])
def test_a_non_text_content_part_is_a_clear_400(served_model, part):
    kind = part["type"]
    body = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]}

    async def scenario(p: Platform):
        return await p.post("/v1/chat/completions", body, "beta")

    fake = FakePod()
    error = _error(run(served_model, [fake], scenario), 400)
    assert error == {"message": f"messages[1].content[1].type: content parts of type '{kind}' are not supported: "
                                "this model takes text only",
                     "type": "invalid_request_error", "param": "messages[1].content[1].type",
                     "code": "unsupported_content_type"}
    assert fake.generated == []


# -- completions' text_offset -------------------------------------------------


def _check_offsets(text: str, logprobs: dict, pieces: list[str]) -> None:
    """text_offset[i] is where token i's piece starts; the pieces tile the text. (After a stop
    string the gateway stops reading: the tokens it got are the first of `pieces`.)"""
    offsets = logprobs["text_offset"]
    assert len(offsets) == len(logprobs["tokens"]) <= len(pieces)
    ends = [*offsets[1:], len(text)]
    assert all(a <= b for a, b in zip(offsets, ends)), offsets  # in order, none past the text's end
    assert [text[a:b] for a, b in zip(offsets, ends)] == pieces[:len(offsets)]
    assert sum(b - a for a, b in zip(offsets, ends)) == len(text)


SCRIPTS = {  # (tokens, stop, each token's piece of the text)
    # A special token decodes to nothing in the text (skip_special_tokens), to 17 characters alone.
    "special token": ([BOS, BAS, BAS, BAS], "zzz", ["", "bas", "bas", "bas"]),
    # Bytes of one character: nothing until the last byte, which brings the whole character.
    "unfinished UTF-8": (None, "zzz", ["bas", "", "", "", EMOJI, "bas"]),
    # A stop string cuts the text: the tokens past the cut start at its end.
    "stop string": ([BAS, PAD, BAS, BAS], "sb", ["ba", "", "", ""]),
}


@pytest.mark.parametrize("per_response", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_text_offset_follows_the_text(served_model, case, stream, per_response):
    script, stop, pieces = SCRIPTS[case]
    if script is None:
        tokenizer = served_model.tokenizer
        script = [BAS, *tokenizer.encode(EMOJI, add_special_tokens=False), BAS]
        assert len(script) == 6
    # A stop string, even one that never matches, holds the stream's last characters back a while.
    body = {"model": MODEL, "prompt": "hi", "max_tokens": len(script), "logprobs": 0, "stream": stream,
            "stop": [stop]}

    async def scenario(p: Platform):
        return await p.post("/v1/completions", body, "beta")

    r = run(served_model, [ScriptedPod(script, per_response)], scenario)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [e["choices"][0] for e in _sse(r.text)]
        text = "".join(c["text"] for c in chunks)
        logprobs = {k: [v for c in chunks for v in c["logprobs"][k]] for k in ("tokens", "text_offset")}
    else:
        (choice,) = r.json()["choices"]
        text, logprobs = choice["text"], choice["logprobs"]
    assert text == "".join(pieces)
    _check_offsets(text, logprobs, pieces)


# -- every refusal counted once ------------------------------------------------


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for m in registry.collect() for s in m.samples
            if s.name == name and s.value}


def test_every_refused_request_is_counted_once_with_its_reason(served_model):
    """Refusals of every kind the REST server answers, each counted once in
    tessera_gateway_rejections_total (with its reason) and in
    tessera_gateway_requests_total{outcome="rejected"}."""
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    beta = {"Authorization": f"Bearer {KEYS['beta']}"}
    bad = [  # (request, reason)
        (lambda p: p.post("/v1/completions", ok, tenant=None), "unauthenticated"),
        (lambda p: p.http.get("/v1/models", headers={"Authorization": "Bearer sk-wrong-0123456789"}),
         "unauthenticated"),
        (lambda p: p.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/a/x"}, "beta"), "not_admin"),
        (lambda p: p.post("/v1/completions", {**ok, "model": "nope"}, "beta"), "model_not_found"),
        (lambda p: p.get("/v1/models/nope"), "model_not_found"),
        (lambda p: p.post("/v1/completions", {**ok, "temperature": -1}, "beta"), "invalid_request"),
        (lambda p: p.post("/v1/completions", {**ok, "echo": True}, "beta"), "invalid_request"),
        (lambda p: p.post("/v1/completions", {**ok, "priority_class": "no-such-class"}, "beta"), "invalid_request"),
        (lambda p: p.post("/v1/completions", {**ok, "max_tokens": 10**6}, "beta"), "invalid_request"),
        (lambda p: p.http.post("/v1/completions", content=b"{", headers=beta), "invalid_request"),
        (lambda p: p.post("/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "beta"),
         "invalid_request"),
        (lambda p: p.http.get("/v1/nothing", headers=beta), "not_found"),
        (lambda p: p.http.put("/v1/completions", headers=beta), "method_not_allowed"),
    ]

    async def scenario(p: Platform):
        statuses = [(await send(p)).status_code for send, _ in bad]
        good = await p.post("/v1/completions", ok, "beta")
        return statuses, good.status_code, p.gateway.metrics.registry

    statuses, good, registry = run(served_model, [FakePod()], scenario)
    assert all(400 <= s < 500 for s in statuses), statuses
    assert good == 200
    reasons: dict[str, float] = {}
    for labels, value in _samples(registry, "tessera_gateway_rejections_total").items():
        reason = dict(labels)["reason"]
        reasons[reason] = reasons.get(reason, 0) + value
    expected: dict[str, float] = {}
    for _, reason in bad:
        expected[reason] = expected.get(reason, 0) + 1
    assert reasons == expected
    outcomes = _samples(registry, "tessera_gateway_requests_total")
    rejected = sum(v for labels, v in outcomes.items() if dict(labels)["outcome"] == "rejected")
    assert rejected == len(bad)
    assert sum(v for labels, v in outcomes.items() if dict(labels)["outcome"] == "ok") == 1
    # No label holds what the client sent: unknown classes, models and paths are not label values.
    values = {v for labels in outcomes for _, v in labels}
    assert not values & {"no-such-class", "nope", "/v1/nothing"}


def test_a_refusal_seen_twice_counts_once():
    from gateway.errors import bad_request
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    error = bad_request("no")
    count_rejection(metrics, error, ("t", ""), "completions")
    count_rejection(metrics, error, ("t", ""), "completions")
    assert metrics.rejections.labels("t", "", "invalid_request")._value.get() == 1
    assert metrics.requests.labels("t", "", "completions", "rejected")._value.get() == 1
