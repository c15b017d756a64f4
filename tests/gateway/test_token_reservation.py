"""tokens_per_minute end to end: admission reserves the prompt plus
n x max_tokens, so one request cannot overrun the limit, and a request that
could never fit gets OpenAI's "Request too large" 429 without Retry-After
(the tenant `tpm-reserve` has 100 tokens/min)."""

from __future__ import annotations

import grpc
import httpx
import pytest

from tests.gateway.conftest import KEYS, MODEL_NAME
from tessera.v1 import inference_pb2 as pb
from tessera.v1 import inference_pb2_grpc as pb_grpc

HEADERS = {"Authorization": f"Bearer {KEYS['tpm-reserve']}"}


def _complete(platform, **body) -> httpx.Response:
    return httpx.post(platform.base_url + "/v1/completions", headers=HEADERS, timeout=30,
                      json={"model": MODEL_NAME, "prompt": "Hello", "ignore_eos": True, **body})


def test_a_request_that_can_never_fit_is_too_large_at_once(platform):
    # The shape (n=16, long outputs) against the tenant's 100 tokens/min.
    r = _complete(platform, n=16, max_tokens=200)
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "tokens_per_minute" and "Request too large" in error["message"]
    assert "retry-after" not in r.headers  # waiting cannot help
    with grpc.insecure_channel(platform.grpc_address) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.InferenceStub(channel).CompleteUnary(
            pb.CompletionRequest(model=MODEL_NAME, prompt="Hello", params=pb.GenerationParams(n=16, max_tokens=200)),
            metadata=(("authorization", HEADERS["Authorization"]),), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Request too large" in err.value.details()
    assert "retry-after" not in dict(err.value.trailing_metadata())


def test_output_is_reserved_at_admission(platform):
    first = _complete(platform, n=2, max_tokens=40)  # a few prompt tokens + 80 reserved, all generated
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == 80
    # About 15 tokens are left (plus the refill of a second or two): a prompt
    # of a few tokens would pass a prompt-only check, its 30 output tokens do not.
    second = _complete(platform, max_tokens=30)
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "tokens_per_minute"
    assert int(second.headers["retry-after"]) >= 1
