"""The key is checked before the body: a request without a valid key gets
401 (gRPC UNAUTHENTICATED) whatever its body holds, as OpenAI answers, and
learns nothing about the API from validation errors."""

from __future__ import annotations

import grpc
import httpx
import pytest

from tests.gateway.conftest import KEYS, MODEL_NAME
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc

BAD_BODIES = {
    "not-json": b'{"model": "tiny", "prompt": [',
    "out-of-range": b'{"model": "tiny", "prompt": "hi", "temperature": 9}',
    "unknown-field": b'{"model": "tiny", "prompt": "hi", "bogus": 1}',
    "lone-surrogate": b'{"model": "tiny", "prompt": "\\ud800"}',
    "not-an-object": b'[]',
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_rest_without_a_valid_key_is_401_whatever_the_body(platform, path, body, key):
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    r = httpx.post(platform.base_url + path, content=body, headers=headers)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES)
def test_rest_with_a_valid_key_a_bad_body_is_400(platform, body):
    r = httpx.post(platform.base_url + "/v1/completions", content=body,
                   headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEYS['alice']}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


BAD_MESSAGES = [
    ("Complete", pb.CompletionRequest(model=MODEL_NAME, prompt="hi", prompt_token_ids=[1, 2])),
    ("CompleteUnary", pb.CompletionRequest(model=MODEL_NAME, prompt="hi", params=pb.GenerationParams(n=99))),
    ("ChatUnary", pb.ChatRequest(model=MODEL_NAME)),  # no messages
    ("Chat", pb.ChatRequest(model=MODEL_NAME, messages=[pb.ChatMessage(role="wizard", content="hi")])),
]


@pytest.mark.parametrize("method,message", BAD_MESSAGES, ids=[m for m, _ in BAD_MESSAGES])
def test_grpc_without_a_valid_key_is_unauthenticated_whatever_the_message(platform, method, message):
    with grpc.insecure_channel(platform.grpc_address) as channel:
        call = getattr(pb_grpc.InferenceStub(channel), method)
        for metadata in ((), (("authorization", "Bearer sk-wrong"),)):
            with pytest.raises(grpc.RpcError) as err:
                result = call(message, metadata=metadata, timeout=10)
                list(result) if method in ("Complete", "Chat") else result
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # with the key: the message's own fault
            result = call(message, metadata=(("authorization", f"Bearer {KEYS['grpc']}"),), timeout=10)
            list(result) if method in ("Complete", "Chat") else result
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("method,streams", [("CompleteUnary", False), ("Chat", True), ("ListModels", False)])
def test_grpc_bytes_that_are_no_message_are_invalid_argument_after_the_key(platform, method, streams):
    """grpc itself would answer UNKNOWN ("Unexpected DecodeError")."""
    with grpc.insecure_channel(platform.grpc_address) as channel:
        path = f"/tessera.v1.Inference/{method}"
        call = channel.unary_stream(path) if streams else channel.unary_unary(path)
        for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                               ((("authorization", f"Bearer {KEYS['grpc']}"),), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as err:
                result = call(b"\x0a\xff\xff\xff\xff", metadata=metadata, timeout=10)
                list(result) if streams else result
            assert err.value.code() == code, err.value.details()
            assert err.value.details()
