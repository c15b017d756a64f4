"""Datasets of `tessera bench serve`: the JSONL format and its errors, the
synthetic prompts' token lengths, shared-prefix groups, request bodies."""

from __future__ import annotations

import json

import pytest

from tessera_tools.bench.serve.client import Target
from tessera_tools.bench.serve.dataset import (
    ServeRequest,
    check_endpoint,
    load_jsonl,
    synthetic_requests,
    with_prefix_groups,
)
from tessera.text import encode_prompt, load_tokenizer
from tests.conftest import checkpoint

GOOD = json.dumps({"prompt": "Tell me a story.", "output_len": 16})
CHAT = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "output_len": 4})


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_tokenizer(checkpoint("tiny"))
    tok.model_max_length = int(1e30)
    return tok


def write(tmp_path, lines: list[str]):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_prompts_and_messages_cycle_to_the_count(tmp_path, tokenizer):
    requests = load_jsonl(write(tmp_path, [GOOD, "", CHAT]), num_requests=5, tokenizer=tokenizer)
    assert len(requests) == 5
    assert requests[0].prompt == "Tell me a story." and requests[0].output_len == 16
    assert requests[0].prompt_len == len(encode_prompt(tokenizer, "Tell me a story.", add_special_tokens=False))
    assert requests[1].messages == [{"role": "user", "content": "Hi"}] and requests[1].prompt_len is None
    assert requests[2] == requests[0] and requests[4] == requests[0]
    assert load_jsonl(write(tmp_path, [GOOD, CHAT]), num_requests=1)[0].prompt_len is None  # no tokenizer


@pytest.mark.parametrize("bad_line, message", [
    ('{"prompt": "x", "output_len": 4', "not valid JSON"),
    ('["prompt", 4]', "expected a JSON object"),
    ('{"output_len": 4}', "exactly one of"),
    ('{"prompt": "x", "messages": [], "output_len": 4}', "exactly one of"),
    ('{"prompt": "x"}', "output_len"),
    ('{"prompt": "x", "output_len": 0}', "output_len"),
    ('{"prompt": "x", "output_len": true}', "output_len"),
    ('{"prompt": "x", "output_len": "8"}', "output_len"),
    ('{"prompt": "", "output_len": 4}', "non-empty string"),
    ('{"messages": [], "output_len": 4}', "messages"),
    ('{"messages": [{"content": "x"}], "output_len": 4}', "messages"),
])
def test_jsonl_errors_name_the_line(tmp_path, bad_line, message):
    path = write(tmp_path, [GOOD, "", bad_line])
    with pytest.raises(ValueError, match=message) as error:
        load_jsonl(path, num_requests=3)
    assert f"{path} line 3" in str(error.value)


def test_empty_jsonl(tmp_path):
    with pytest.raises(ValueError, match="no requests"):
        load_jsonl(write(tmp_path, ["", "  "]), num_requests=3)


def test_chat_messages_need_the_chat_endpoint():
    with pytest.raises(ValueError, match="--endpoint chat"):
        check_endpoint([ServeRequest(4, messages=[{"role": "user", "content": "x"}])], "completions")
    check_endpoint([ServeRequest(4, prompt="x")], "chat")


def test_synthetic_prompts_have_their_token_lengths(tokenizer):
    requests = synthetic_requests(tokenizer, 20, max_prompt_len=64, max_output_len=16, seed=3)
    assert requests == synthetic_requests(tokenizer, 20, max_prompt_len=64, max_output_len=16, seed=3)
    for r in requests:
        assert r.prompt_len == len(encode_prompt(tokenizer, r.prompt, add_special_tokens=False))
        assert 4 <= r.prompt_len <= 64 and 1 <= r.output_len <= 16


def test_prefix_groups(tokenizer):
    base = synthetic_requests(tokenizer, 24, max_prompt_len=32, max_output_len=8, seed=0)
    grouped = with_prefix_groups(base, tokenizer, num_groups=3, prefix_len=40, seed=0)
    prefixes = {r.prompt[: len(r.prompt) - len(b.prompt)] for r, b in zip(grouped, base)}
    assert len(prefixes) == 3
    assert all(r.prompt.endswith(b.prompt) for r, b in zip(grouped, base))
    for prefix in prefixes:
        assert len(encode_prompt(tokenizer, prefix, add_special_tokens=False)) in range(38, 43)
    chat = with_prefix_groups([ServeRequest(4, messages=[{"role": "user", "content": "Q"}])], tokenizer, 1, 8, 0)
    assert chat[0].messages[0]["content"].endswith("\nQ")


def test_request_bodies():
    request = ServeRequest(12, prompt="Hello")
    completions = Target("http://h/v1", "completions", "m").body(request)
    assert completions == {"model": "m", "prompt": "Hello", "max_tokens": 12, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}, "temperature": 0.0}
    chat = Target("http://h/v1", "chat", "m", ignore_eos=False).body(request, max_tokens=2)
    assert chat["messages"] == [{"role": "user", "content": "Hello"}] and chat["max_completion_tokens"] == 2
    assert "ignore_eos" not in chat and "max_tokens" not in chat
    assert Target("http://h/v1", "chat", "m").url == "http://h/v1/chat/completions"
