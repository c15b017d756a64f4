"""What `tessera bench fuzz` sends: seeded valid requests across every
documented range, and malformed ones, each a valid request with one thing
wrong (its `kind` names what), over REST and gRPC.

A valid request keeps its prompt short and max_tokens small, so it fits the
gateway's context and costs the engine little; it may still be refused with
a 4xx (a shed class under load, say), which is an answer, not a failure.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from tessera.v1 import inference_pb2 as pb

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SEEDS = [None, 0, 1, -1, INT64_MIN, INT64_MIN + 1, INT64_MAX - 16, INT64_MAX - 1, INT64_MAX]
WORDS = ["hello", "world", "the", "quick", "fox", "tessera", "ünïcode", "日本語", "🙂", "a\nb", "\t", "0"]


@dataclass
class RestCase:
    kind: str                 # "valid", or what is wrong
    valid: bool
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    stream: bool = False
    n: int = 1


@dataclass
class GrpcCase:
    kind: str
    valid: bool
    method: str               # Complete, CompleteUnary, Chat, ChatUnary, ListModels
    message: object           # the request message, or raw bytes
    metadata: list[tuple[str, str]] = field(default_factory=list)
    n: int = 1


@dataclass(frozen=True)
class Target:
    model: str
    api_key: str | None       # None: open access
    max_model_len: int
    vocab_size: int


class Cases:
    def __init__(self, target: Target, seed: int, max_tokens: int) -> None:
        self.t = target
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens

    # -- shared pieces ------------------------------------------------------
    def _text(self, words: int | None = None) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words or self.rng.randint(1, 5)))

    def _sampling(self) -> dict:
        """Valid sampling fields (REST names; gRPC takes the same values)."""
        r = self.rng
        f: dict = {"n": r.choice([1, 1, 1, 2, 3, 4, 8, 16]), "max_tokens": r.randint(1, self.max_tokens)}
        optional = {
            "seed": lambda: r.choice(SEEDS[1:] + [r.randint(INT64_MIN, INT64_MAX)]),
            "temperature": lambda: r.choice([0.0, 0.5, 1.0, 2.0, r.uniform(0, 2)]),
            "top_p": lambda: r.choice([1.0, 0.5, 1e-6, r.uniform(0.01, 1)]),
            "top_k": lambda: r.choice([-1, 0, 1, 50, INT32_MAX]),
            "min_p": lambda: r.choice([0.0, 0.1, 1.0]),
            "presence_penalty": lambda: r.uniform(-2, 2),
            "frequency_penalty": lambda: r.uniform(-2, 2),
            "repetition_penalty": lambda: r.choice([0.5, 1.0, 2.0]),
            "stop": lambda: r.choice([self._text(1), [self._text(1) for _ in range(r.randint(1, 16))]]),
            "stop_token_ids": lambda: [r.randrange(self.t.vocab_size) for _ in range(r.randint(0, 64))],
            "ignore_eos": lambda: r.random() < 0.5,
            "min_tokens": lambda: r.randint(0, f["max_tokens"]),
            "priority_class": lambda: r.choice(["standard", "critical"]),
        }
        for name, make in optional.items():
            if r.random() < 0.3:
                f[name] = make()
        return f

    def _prompt_ids(self) -> list[int]:
        return [self.rng.randrange(self.t.vocab_size) for _ in range(self.rng.randint(1, 8))]

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.t.api_key}"} if self.t.api_key else {}

    # -- REST ---------------------------------------------------------------
    def rest_valid_body(self) -> tuple[str, dict]:
        r = self.rng
        body = {"model": self.t.model, **self._sampling()}
        if r.random() < 0.5:
            body["prompt"] = r.choice([self._text(), self._prompt_ids(), [self._text()]])
            if r.random() < 0.3:
                body["logprobs"] = r.randint(0, 5)
            path = "/v1/completions"
        else:
            body["messages"] = [{"role": r.choice(["system", "user"]), "content": self._text()}] + \
                [{"role": "user", "content": r.choice([self._text(), [{"type": "text", "text": self._text()}]])}]
            if r.random() < 0.3:
                body["logprobs"] = True
                body["top_logprobs"] = r.randint(0, 20)
            path = "/v1/chat/completions"
        if r.random() < 0.5:
            body["stream"] = True
            if r.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        if r.random() < 0.05:
            body["response_format"] = {"type": "json_object"}
        return path, body

    def rest_valid(self) -> RestCase:
        path, body = self.rest_valid_body()
        return RestCase("valid", True, "POST", path, json.dumps(body).encode(),
                        {"Content-Type": "application/json", **self._auth()}, bool(body.get("stream")), body["n"])

    def rest_malformed(self) -> RestCase:
        path, body = self.rest_valid_body()
        headers = {"Content-Type": "application/json", **self._auth()}
        kind, mutate = self.rng.choice(_REST_MUTATIONS)
        case = RestCase(kind, False, "POST", path, None, headers, bool(body.get("stream")), body["n"])
        raw = mutate(self, case, body)
        case.body = raw if isinstance(raw, bytes) else json.dumps(body).encode()
        return case

    # -- gRPC ---------------------------------------------------------------
    def _params(self, f: dict) -> pb.GenerationParams:
        names = {"n", "max_tokens", "seed", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens"}
        params = pb.GenerationParams(**{k: v for k, v in f.items() if k in names})
        stop = f.get("stop")
        params.stop.extend([stop] if isinstance(stop, str) else stop or [])
        return params

    def grpc_valid(self) -> GrpcCase:
        r = self.rng
        f = self._sampling()
        params = self._params(f)
        stream = r.random() < 0.5
        if r.random() < 0.5:
            if r.random() < 0.3:
                params.logprobs = r.randint(0, 20)
            prompt = self._text() if r.random() < 0.5 else None
            message = pb.CompletionRequest(model=self.t.model, prompt=prompt or "",
                                           prompt_token_ids=[] if prompt else self._prompt_ids(), params=params,
                                           priority_class=f.get("priority_class", ""))
            method = "Complete" if stream else "CompleteUnary"
        else:
            message = pb.ChatRequest(model=self.t.model, params=params,
                                     messages=[pb.ChatMessage(role="user", content=self._text())],
                                     priority_class=f.get("priority_class", ""))
            method = "Chat" if stream else "ChatUnary"
        return GrpcCase("valid", True, method, message, self._metadata(), f["n"])

    def _metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.t.api_key}")] if self.t.api_key else []

    def grpc_malformed(self) -> GrpcCase:
        case = self.grpc_valid()
        kind, mutate = self.rng.choice(_GRPC_MUTATIONS)
        case.kind, case.valid = kind, False
        mutate(self, case)
        return case


# -- REST mutations: (kind, fn(cases, case, body) -> raw bytes or None (send `body`)) --------------

def _set(**fields):
    def mutate(c: Cases, case: RestCase, body: dict):
        body.update(fields)
    return mutate


def _drop(name):
    def mutate(c: Cases, case: RestCase, body: dict):
        body.pop(name, None)
        body.pop("messages" if name == "prompt" else "prompt", None)
    return mutate


def _raw(data: bytes):
    return lambda c, case, body: data


def _header(headers: dict | None = None, drop: str | None = None):
    def mutate(c: Cases, case: RestCase, body: dict):
        case.headers.pop(drop, None) if drop else case.headers.update(headers)
    return mutate


def _route(method: str, path: str):
    def mutate(c: Cases, case: RestCase, body: dict):
        case.method, case.path, case.stream = method, path, False
    return mutate


def _deep(depth: int):
    def mutate(c: Cases, case: RestCase, body: dict):
        return b'{"model": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
    return mutate


def _prompt_over_context(c: Cases, case: RestCase, body: dict):
    words = " ".join(["word"] * (c.t.max_model_len * 2))
    if case.path == "/v1/completions":
        body["prompt"] = words
    else:
        body["messages"] = [{"role": "user", "content": words}]


def _in_prompt(value):
    """A completions prompt (a chat case becomes a completion: empty chat content is valid)."""
    def mutate(c: Cases, case: RestCase, body: dict):
        case.path = "/v1/completions"
        body.pop("messages", None)
        body.pop("top_logprobs", None)
        body.pop("logprobs", None)
        body["prompt"] = value
    return mutate


def _surrogate(c: Cases, case: RestCase, body: dict):
    """A lone surrogate (JSON's \\ud800 escape) in the prompt, which is tokenized, or in `user`."""
    if c.rng.random() < 0.5:
        _in_prompt("SURROGATE")(c, case, body)
    else:
        body["user"] = "SURROGATE"
    return json.dumps(body).replace('"SURROGATE"', '"\\ud800x"').encode()


_REST_MUTATIONS = [
    ("not_json", _raw(b'{"model": "tiny", "prompt": [')),
    ("empty_body", _raw(b"")),
    ("invalid_utf8", _raw(b'{"model": "\xff\xfe", "prompt": "x"}')),
    ("json_array", _raw(b"[]")),
    ("json_scalar", _raw(b"42")),
    ("json_null", _raw(b"null")),
    ("deep_nesting", _deep(5000)),
    ("lone_surrogate", _surrogate),
    ("missing_model", lambda c, case, body: body.pop("model")),
    ("missing_prompt", _drop("prompt")),
    ("unknown_field", _set(bogus_field=1)),
    ("unknown_model", _set(model="no-such-model")),
    ("n_zero", _set(n=0)), ("n_17", _set(n=17)), ("n_huge", _set(n=10**20)), ("n_string", _set(n="two")),
    ("n_float", _set(n=1.5)), ("n_bool", _set(n=True)), ("n_numeric_string", _set(n="2")),
    ("stream_string", _set(stream="true")), ("temperature_bool", _set(temperature=True)),
    ("seed_over_int64", _set(seed=2**63)), ("seed_under_int64", _set(seed=-(2**63) - 1)),
    ("seed_huge", _set(seed=10**40)), ("seed_float", _set(seed=1.5)),
    ("max_tokens_zero", _set(max_tokens=0)), ("max_tokens_negative", _set(max_tokens=-1)),
    ("max_tokens_over_int32", _set(max_tokens=2**31)), ("max_tokens_huge", _set(max_tokens=10**30)),
    ("max_tokens_over_context", lambda c, case, body: body.update(max_tokens=c.t.max_model_len)),
    ("temperature_negative", _set(temperature=-0.5)), ("temperature_3", _set(temperature=3)),
    ("temperature_string", _set(temperature="hot")), ("temperature_huge", _set(temperature=1e308)),
    ("top_p_zero", _set(top_p=0)), ("top_p_over_1", _set(top_p=1.5)),
    ("top_k_minus_2", _set(top_k=-2)), ("top_k_over_int32", _set(top_k=2**31)),
    ("min_p_over_1", _set(min_p=2)), ("presence_over_2", _set(presence_penalty=2.5)),
    ("repetition_zero", _set(repetition_penalty=0)),
    ("min_tokens_negative", _set(min_tokens=-1)), ("min_tokens_over_max", _set(min_tokens=10**6)),
    ("min_tokens_over_int32", _set(min_tokens=2**31)),
    ("stop_empty_string", _set(stop="")), ("stop_17", _set(stop=["x"] * 17)), ("stop_int", _set(stop=5)),
    ("stop_token_ids_negative", _set(stop_token_ids=[-1])),
    ("stop_token_ids_over_int32", _set(stop_token_ids=[2**31])),
    ("stop_token_ids_over_vocab", lambda c, case, body: body.update(stop_token_ids=[c.t.vocab_size])),
    ("stop_token_ids_65", _set(stop_token_ids=[1] * 65)),
    ("logprobs_6", _set(logprobs=6)), ("logprobs_negative", _set(logprobs=-1)),
    ("top_logprobs_21", _set(logprobs=True, top_logprobs=21)),
    ("prompt_empty", _in_prompt("")), ("prompt_token_negative", _in_prompt([-1])),
    ("prompt_token_over_vocab", lambda c, case, body: _in_prompt([c.t.vocab_size])(c, case, body)),
    ("prompt_token_over_int32", _in_prompt([2**31])), ("prompt_batch", _in_prompt(["a", "b"])),
    ("prompt_object", _in_prompt({"a": 1})), ("prompt_over_context", _prompt_over_context),
    ("messages_empty", lambda c, case, body: body.update(messages=[]) if "messages" in body else
     body.update(prompt=[])),
    ("bad_role", lambda c, case, body: body.update(messages=[{"role": "wizard", "content": "hi"}])),
    ("bad_content_part", lambda c, case, body: body.update(
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
    ("echo", _set(echo=True)), ("suffix", _set(suffix="x")), ("logit_bias", _set(logit_bias={"1": 5})),
    ("best_of", _set(best_of=3, n=1)), ("tools", _set(tools=[{"type": "function"}])),
    ("priority_class_unknown", _set(priority_class="no-such-class")),
    ("user_too_long", _set(user="u" * 1000)),
    ("stream_options_bad", _set(stream_options={"include_usage": "yes"})),
    ("response_format_bad_type", _set(response_format={"type": "xml"})),
    ("response_format_bad_schema", _set(response_format={"type": "json_schema", "json_schema": {"schema": 5}})),
    ("guided_regex_bad", _set(guided_regex="(")),
    ("guided_choice_empty", _set(guided_choice=[])),
    ("guided_grammar_bad", _set(guided_grammar="root ::= ((")),
    ("two_constraints", _set(guided_regex="a+", response_format={"type": "json_object"})),
    ("deep_schema", lambda c, case, body: _with_raw(body, "guided_json", _nested_schema(5000))),
    ("no_key", _header(drop="Authorization")),
    ("wrong_key", _header({"Authorization": "Bearer sk-wrong-key"})),
    ("basic_auth", _header({"Authorization": "Basic dXNlcjpwYXNz"})),
    ("bearer_only", _header({"Authorization": "Bearer"})),
    ("text_plain", _header({"Content-Type": "text/plain"})),
    ("get_method", _route("GET", "/v1/completions")),
    ("unknown_path", _route("POST", "/v1/nope")),
    ("metrics_on_public_port", _route("GET", "/metrics")),
]


def _nested_schema(depth: int) -> str:
    """A JSON schema nested `depth` objects deep, as JSON text (too deep for json.dumps)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + '}, "required": ["a"]}' * depth


def _with_raw(body: dict, name: str, raw_json: str) -> bytes:
    """The body with field `name` set to already-encoded JSON."""
    return json.dumps({**body, name: None}).replace(f'"{name}": null', f'"{name}": {raw_json}').encode()


# -- gRPC mutations: (kind, fn(cases, case)) -----------------------------------------------------

def _params_of(case: GrpcCase) -> pb.GenerationParams:
    return case.message.params


def _p(**fields):
    def mutate(c: Cases, case: GrpcCase):
        p = _params_of(case)
        for k, v in fields.items():
            if isinstance(v, list):
                getattr(p, k)[:] = v
            else:
                setattr(p, k, v)
    return mutate


def _completion_only(fn):
    """Applies to completions; turns a chat case into a completion first."""
    def mutate(c: Cases, case: GrpcCase):
        if not isinstance(case.message, pb.CompletionRequest):
            case.message = pb.CompletionRequest(model=case.message.model, prompt="hi", params=case.message.params)
            case.method = "Complete" if case.method == "Chat" else "CompleteUnary"
        fn(c, case)
    return mutate


def _chat_only(fn):
    def mutate(c: Cases, case: GrpcCase):
        if not isinstance(case.message, pb.ChatRequest):
            case.message = pb.ChatRequest(model=case.message.model, params=case.message.params,
                                          messages=[pb.ChatMessage(role="user", content="hi")])
            case.method = "Chat" if case.method == "Complete" else "ChatUnary"
        fn(c, case)
    return mutate


def _set_prompt(prompt: str = "", ids: list[int] | None = None):
    def mutate(c: Cases, case: GrpcCase):
        case.message.prompt = prompt
        case.message.prompt_token_ids[:] = ids or []
    return mutate


def _metadata(value: list[tuple[str, str]]):
    def mutate(c: Cases, case: GrpcCase):
        case.metadata = value
    return mutate


_GRPC_MUTATIONS = [
    ("no_key", _metadata([])),
    ("wrong_key", _metadata([("authorization", "Bearer sk-wrong-key")])),
    ("malformed_auth", _metadata([("authorization", "Token x")])),
    ("unknown_model", lambda c, case: setattr(case.message, "model", "no-such-model")),
    ("n_zero", _p(n=0)), ("n_17", _p(n=17)), ("n_max", _p(n=INT32_MAX)), ("n_negative", _p(n=-1)),
    ("max_tokens_zero", _p(max_tokens=0)), ("max_tokens_negative", _p(max_tokens=-5)),
    ("max_tokens_max", _p(max_tokens=INT32_MAX)),
    ("temperature_nan", _p(temperature=float("nan"))), ("temperature_inf", _p(temperature=float("inf"))),
    ("temperature_negative", _p(temperature=-1)), ("top_p_zero", _p(top_p=0)),
    ("top_p_nan", _p(top_p=float("nan"))), ("top_k_minus_5", _p(top_k=-5)),
    ("min_p_negative", _p(min_p=-0.5)), ("repetition_negative", _p(repetition_penalty=-1)),
    ("frequency_inf", _p(frequency_penalty=float("-inf"))),
    ("logprobs_21", _p(logprobs=21)), ("logprobs_negative", _p(logprobs=-1)),
    ("min_tokens_negative", _p(min_tokens=-1)), ("min_tokens_max", _p(min_tokens=INT32_MAX)),
    ("stop_token_ids_negative", _p(stop_token_ids=[-1])), ("stop_token_ids_max", _p(stop_token_ids=[INT32_MAX])),
    ("stop_token_ids_65", _p(stop_token_ids=[1] * 65)),
    ("stop_17", _p(stop=["x"] * 17)), ("stop_empty", _p(stop=[""])),
    ("structured_regex_bad", lambda c, case: setattr(_params_of(case).structured_outputs, "regex", "(")),
    ("structured_json_bad", lambda c, case: setattr(_params_of(case).structured_outputs, "json", "{not json")),
    ("structured_json_deep", lambda c, case: setattr(_params_of(case).structured_outputs, "json",
                                                     "[" * 100_000 + "]" * 100_000)),
    ("priority_class_unknown", lambda c, case: setattr(case.message, "priority_class", "no-such-class")),
    ("prompt_and_ids", _completion_only(_set_prompt("hi", [1, 2]))),
    ("prompt_empty", _completion_only(_set_prompt(""))),
    ("prompt_token_negative", _completion_only(_set_prompt("", [-1]))),
    ("prompt_token_over_vocab", _completion_only(lambda c, case: _set_prompt("", [c.t.vocab_size])(c, case))),
    ("prompt_over_context", _completion_only(lambda c, case: _set_prompt(
        " ".join(["word"] * (c.t.max_model_len * 2)))(c, case))),
    ("messages_empty", _chat_only(lambda c, case: case.message.ClearField("messages"))),
    ("bad_role", _chat_only(lambda c, case: case.message.messages[0].__setattr__("role", "wizard"))),
    # Bytes that are no protobuf message at all (sent on a raw channel).
    ("undecodable_bytes", lambda c, case: setattr(case, "message", b"\x0a\xff\xff\xff\xff")),
    ("random_bytes", lambda c, case: setattr(case, "message", c.rng.randbytes(c.rng.randint(1, 64)))),
]
