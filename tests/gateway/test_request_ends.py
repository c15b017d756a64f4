"""No request without an end: whatever fails inside a request's tasks
(building the engine request, the engine call, detokenizing, rendering),
the client gets an answer within a bound: an HTTP status before the stream
starts, an error event and then [DONE] after, a gRPC status. Logged once.

The failures are injected into an in-process gateway (the real pipeline,
REST app and gRPC service on this test's loop) in front of the real engine
pods; the seed overflow that used to hang is checked on the real gateway
process too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import grpc
import httpx
import pytest

from gateway.config import gateway_config_from_dict
from gateway.grpc_service import InferenceService, add_to_server
from gateway.main import build_gateway
from gateway.openai_api.server import build_app
from gateway.pods.discovery import static_members
from gateway.request import SamplingOptions
from tessera.sampling_limits import INT64_MAX, INT64_MIN
from tests.gateway.conftest import KEYS, MODEL_NAME, gateway_config, write_tenants
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc

# Far longer than any of these requests takes; a hang is caught by it.
BOUND_S = 20.0
AUTH = {"Authorization": f"Bearer {KEYS['alice']}"}
GRPC_AUTH = (("authorization", f"Bearer {KEYS['alice']}"),)


# -- the seed overflow that hung every n >= 2 request ------------------------------

def _seeded(seed: int, n: int, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "n": n, "seed": seed, "temperature": 1.0,
            "ignore_eos": True, **extra}


def test_n_choices_with_the_largest_seed_answer(platform):
    url = platform.base_url + "/v1/completions"
    r = httpx.post(url, json=_seeded(INT64_MAX, 2), headers=AUTH, timeout=BOUND_S)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1] and all(c["finish_reason"] == "length" for c in choices)
    # Choice 1's seed wraps to INT64_MIN: the same draw as a lone request with that seed.
    alone = httpx.post(url, json=_seeded(INT64_MIN, 1), headers=AUTH, timeout=BOUND_S).json()
    assert alone["choices"][0]["text"] == choices[1]["text"]
    with httpx.stream("POST", url, json=_seeded(INT64_MAX, 3, stream=True), headers=AUTH, timeout=BOUND_S) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    with grpc.insecure_channel(platform.grpc_address) as channel:
        params = pb.GenerationParams(max_tokens=4, n=2, seed=INT64_MAX, temperature=1.0, ignore_eos=True)
        result = pb_grpc.InferenceStub(channel).CompleteUnary(
            pb.CompletionRequest(model=MODEL_NAME, prompt="Hello", params=params), metadata=GRPC_AUTH,
            timeout=BOUND_S)
    assert sorted(c.index for c in result.choices) == [0, 1]


def test_child_seeds_wrap_to_int64_and_draw_what_the_offline_llm_draws():
    import torch

    from gateway.request import child_seed

    assert child_seed(7, 3) == 10 and child_seed(-5, 2) == -3
    assert child_seed(INT64_MAX, 1) == INT64_MIN and child_seed(INT64_MAX, 16) == INT64_MIN + 15
    for seed, index in ((INT64_MAX, 1), (INT64_MAX - 3, 9), (INT64_MIN, 0), (-1, 1)):
        # The offline LLM seeds torch with the unwrapped seed + index.
        wrapped, unwrapped = torch.Generator(), torch.Generator()
        wrapped.manual_seed(child_seed(seed, index))
        unwrapped.manual_seed((seed + index) % 2**64)
        assert wrapped.initial_seed() == unwrapped.initial_seed()


# -- integers out of the wire's range: 400 naming the field, before any engine time --

@pytest.mark.parametrize("body,param", [
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"top_k": 2**31}, "top_k"),
    ({"min_tokens": 2**31}, "min_tokens"),
    ({"n": 17}, "n"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    # In the proto's range but not the model's: the gateway, not the engine, says so.
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"max_tokens": None, "min_tokens": 10**6}, "min_tokens"),
    ({"prompt": [2**31]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
])
def test_out_of_range_integers_are_400_naming_the_field(platform, body, param):
    r = httpx.post(platform.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", **body},
                   headers=AUTH, timeout=BOUND_S)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("params,field", [
    (pb.GenerationParams(stop_token_ids=[2**31 - 1]), "stop_token_ids"),
    (pb.GenerationParams(stop_token_ids=list(range(65))), "stop_token_ids"),
    (pb.GenerationParams(min_tokens=2**31 - 1), "min_tokens"),
    (pb.GenerationParams(top_k=-2), "top_k"),
    (pb.GenerationParams(n=2**31 - 1), "n"),
    (pb.GenerationParams(max_tokens=-1), "max_tokens"),
])
def test_grpc_out_of_range_integers_are_invalid_argument(platform, params, field):
    with grpc.insecure_channel(platform.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.InferenceStub(channel).CompleteUnary(
                pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=params), metadata=GRPC_AUTH,
                timeout=BOUND_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()


# -- failures injected into an in-process gateway ----------------------------------

@contextlib.asynccontextmanager
async def _gateway(tiny_llama, engine_pods, tmp_path):
    """The pipeline, REST app and gRPC service in this process, on this loop."""
    config = gateway_config_from_dict(gateway_config(
        tiny_llama, [(p, "mixed") for p in engine_pods], write_tenants(tmp_path / "tenants.yaml")))
    gateway = build_gateway(config)
    for role, addresses in static_members(config.pods).items():
        gateway.pool.set_members(role, addresses)
    server = grpc.aio.server()
    add_to_server(InferenceService(gateway), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        while len(gateway.pool.routable()) < len(engine_pods):
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(gateway)),
                                     base_url="http://gateway", headers=AUTH, timeout=BOUND_S) as rest, \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield rest, pb_grpc.InferenceStub(channel)
    finally:
        await server.stop(0)
        await gateway.close()


def _run(tiny_llama, engine_pods, tmp_path, scenario) -> None:
    async def main():
        async with _gateway(tiny_llama, engine_pods, tmp_path) as (rest, stub):
            await asyncio.wait_for(scenario(rest, stub), BOUND_S)
    asyncio.run(main())


def _events(body: str) -> list:
    """The SSE events of a body: parsed JSON, or the string "[DONE]"."""
    data = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def _grpc_request(n: int, max_tokens: int = 4) -> pb.CompletionRequest:
    return pb.CompletionRequest(model=MODEL_NAME, prompt="Hello",
                                params=pb.GenerationParams(max_tokens=max_tokens, n=n, ignore_eos=True))


def _failures_logged(caplog) -> int:
    """The gateway's ERROR records (grpc.aio may log its own about loops of earlier tests)."""
    return sum(1 for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("gateway"))


def test_a_failing_choice_ends_its_request_everywhere(tiny_llama, engine_pods, tmp_path, monkeypatch, caplog):
    """The bug class of the seed overflow: building the second choice's
    engine request raises inside its task."""
    to_engine = SamplingOptions.to_engine

    def broken(self, max_tokens, child_index):
        if child_index == 1:
            raise ValueError("Value out of range: 9223372036854775808")
        return to_engine(self, max_tokens, child_index)

    monkeypatch.setattr(SamplingOptions, "to_engine", broken)
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "n": 2, "ignore_eos": True}

    async def scenario(rest, stub):
        r = await rest.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
        r = await rest.post("/v1/completions", json={**body, "stream": True})
        if r.status_code == 200:  # choice 0 answered first: the error comes as an event
            events = _events(r.text)
            assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "internal_error"
        else:
            assert r.status_code == 500
        for call in (stub.CompleteUnary, lambda m, **kw: _drain(stub.Complete(m, **kw))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(_grpc_request(2), metadata=GRPC_AUTH)
            assert err.value.code() == grpc.StatusCode.INTERNAL

    with caplog.at_level(logging.ERROR):
        _run(tiny_llama, engine_pods, tmp_path, scenario)
    assert _failures_logged(caplog) == 4  # once per request


async def _drain(call) -> list:
    return [chunk async for chunk in call]


def test_a_failure_after_the_first_output_sends_an_error_then_done(tiny_llama, engine_pods, tmp_path, monkeypatch,
                                                                   caplog):
    from gateway.choice import ChoiceState

    on_response = ChoiceState.on_response

    def broken(self, response):
        if self.num_tokens > 0:  # the second engine response of each choice
            raise RuntimeError("detokenizer bug")
        return on_response(self, response)

    monkeypatch.setattr(ChoiceState, "on_response", broken)
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "stream": True}

    async def scenario(rest, stub):
        for n in (1, 2):
            r = await rest.post("/v1/completions", json={**body, "n": n})
            assert r.status_code == 200
            events = _events(r.text)
            assert "choices" in events[0]
            assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "internal_error", events
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _drain(stub.Complete(_grpc_request(1), metadata=GRPC_AUTH))
        assert err.value.code() == grpc.StatusCode.INTERNAL

    with caplog.at_level(logging.ERROR):
        _run(tiny_llama, engine_pods, tmp_path, scenario)
    # Once per failed choice: 1, then 1 or 2 (the second may be cancelled
    # first, once the first ended the request), then gRPC's 1.
    assert 3 <= _failures_logged(caplog) <= 4


def test_a_front_end_failure_mid_stream_still_ends_the_stream(tiny_llama, engine_pods, tmp_path, monkeypatch):
    """A bug in rendering a chunk (after the stream started) is the front
    end's own: SSE still gets an error event and [DONE], gRPC INTERNAL."""
    import gateway.grpc_service as grpc_service
    import gateway.openai_api.server as server

    def fail_after_first(fn):
        calls = []

        def wrapper(*args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                raise KeyError("render bug")
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(server, "completion_choice", fail_after_first(server.completion_choice))
    monkeypatch.setattr(grpc_service, "_delta", fail_after_first(grpc_service._delta))
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "stream": True}

    async def scenario(rest, stub):
        r = await rest.post("/v1/completions", json=body)
        events = _events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "internal_error", events
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _drain(stub.Complete(_grpc_request(1), metadata=GRPC_AUTH))
        assert err.value.code() == grpc.StatusCode.INTERNAL

    _run(tiny_llama, engine_pods, tmp_path, scenario)


def _nested_schema(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + '}, "required": ["a"]}' * depth


@pytest.mark.parametrize("depth", [600, 5000])
def test_a_schema_nested_too_deeply_is_refused_not_a_server_error(platform, depth):
    body = f'{{"model": "{MODEL_NAME}", "prompt": "hi", "max_tokens": 2, "guided_json": {_nested_schema(depth)}}}'
    body = body.encode()
    r = httpx.post(platform.base_url + "/v1/completions", content=body, timeout=BOUND_S,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    with grpc.insecure_channel(platform.grpc_address) as channel, pytest.raises(grpc.RpcError) as err:
        params = pb.GenerationParams(max_tokens=2)
        params.structured_outputs.json = _nested_schema(depth)
        pb_grpc.InferenceStub(channel).CompleteUnary(pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=params),
                                                     metadata=GRPC_AUTH, timeout=BOUND_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
