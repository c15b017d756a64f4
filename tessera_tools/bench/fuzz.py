"""``tessera bench fuzz``: valid and malformed requests over REST and gRPC,
counting what must never happen.

- **hang**: no answer within the deadline (`--timeout`);
- **server error**: a 5xx, an SSE error event of a 5xx kind, or a gRPC
  code that blames the server (INTERNAL, UNKNOWN, UNAVAILABLE, ...);
- **lost**: no answer at all: the connection closed without a response, an
  SSE stream without its `[DONE]`, a gRPC stream without its usage chunk;
- **bad error shape**: a 4xx that is not OpenAI's error object (gRPC: a
  status without a message).

Valid requests (`tessera_tools/bench/fuzz_cases.py`) span every documented range
and should be served; malformed ones have one thing wrong each and should
get a 4xx. Either way the other outcome is counted (not a failure: a
valid request may be shed under load). It starts a platform of its own (the
tiny checkpoint, two pods, a gateway with a 48-token context and one API
key) unless `--url` names a running gateway, whose API key (if it needs
one) comes from $OPENAI_API_KEY, never the command line. Exit status 1 if
any hang, server error, lost request or bad error shape was seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from tessera_tools.bench.common import markdown_table, resolve_model, work_dir, write_report
from tessera_tools.bench.flags import (
    add_logs_arg, add_model_args, add_output_arg, add_seed_arg, non_negative_int, positive_float, positive_int,
)
from tessera_tools.bench.fuzz_cases import Cases, GrpcCase, RestCase, Target
from tessera_tools.bench.stats import percentile
from tessera.v1 import inference_pb2_grpc as pb_grpc

FAILURES = ("hang", "server_error", "lost", "bad_error_shape")
# Where --url's API key comes from (a credential never goes on the command line).
API_KEY_ENV = "OPENAI_API_KEY"
SERVER_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED}
# SSE error events a server fault sends (OpenAI `type`).
SERVER_ERROR_TYPES = {"internal_error", "service_unavailable"}


@dataclass
class Outcome:
    transport: str
    valid: bool
    kind: str
    result: str               # served | refused | one of FAILURES
    status: str               # HTTP status or gRPC code name
    seconds: float
    detail: str = ""


# -- REST ------------------------------------------------------------------------------

async def rest_call(client: httpx.AsyncClient, case: RestCase, timeout: float) -> tuple[str, str, str]:
    """(result, status, detail) of one REST request."""
    try:
        async with client.stream(case.method, case.path, content=case.body, headers=case.headers,
                                 timeout=timeout) as r:
            text = (await r.aread()).decode(errors="replace")
    except httpx.TimeoutException:
        return "hang", "timeout", f"no answer within {timeout} s"
    except (httpx.TransportError, httpx.StreamError) as e:
        return "lost", type(e).__name__, str(e)[:200]
    status = str(r.status_code)
    if r.status_code >= 500:
        return "server_error", status, text[:200]
    if r.status_code >= 400:
        try:
            error = json.loads(text)["error"]
            ok = bool(error["message"]) and bool(error["type"])
        except (ValueError, KeyError, TypeError):
            ok = False
        return ("refused" if ok else "bad_error_shape"), status, text[:200]
    if not case.stream:
        return "served", status, ""
    return _sse_result(text)


def _sse_result(text: str) -> tuple[str, str, str]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "lost", "200", f"stream without [DONE]: {text[-200:]}"
    for event in events[:-1]:
        error = json.loads(event).get("error")
        if error is not None:
            kind = "server_error" if error.get("type") in SERVER_ERROR_TYPES else "refused"
            return kind, "200+error", event[:200]
    return "served", "200", ""


# -- gRPC ------------------------------------------------------------------------------

async def grpc_call(stub, channel, case: GrpcCase, timeout: float) -> tuple[str, str, str]:
    streams, raw = case.method in ("Complete", "Chat"), isinstance(case.message, bytes)
    if raw:  # no message: straight onto the channel, answers unparsed
        path = f"/tessera.v1.Inference/{case.method}"
        method = channel.unary_stream(path) if streams else channel.unary_unary(path)
    else:
        method = getattr(stub, case.method)
    try:
        if streams:
            chunks = [chunk async for chunk in method(case.message, metadata=case.metadata, timeout=timeout)]
            if not raw and (not chunks or not chunks[-1].HasField("usage")):
                return "lost", "OK", "stream without its usage chunk"
        else:
            await method(case.message, metadata=case.metadata, timeout=timeout)
        return "served", "OK", ""
    except grpc.aio.AioRpcError as e:
        code, detail = e.code(), (e.details() or "")[:200]
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "hang", code.name, f"no answer within {timeout} s"
        if code == grpc.StatusCode.CANCELLED:
            return "lost", code.name, detail
        if code in SERVER_CODES:
            return "server_error", code.name, detail
        return ("refused" if detail else "bad_error_shape"), code.name, detail


# -- the run ---------------------------------------------------------------------------

async def run_cases(cases: list[RestCase | GrpcCase], url: str, grpc_address: str, concurrency: int,
                    timeout: float) -> list[Outcome]:
    outcomes: list[Outcome] = []
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=concurrency)) as client, \
            grpc.aio.insecure_channel(grpc_address) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one(case) -> None:
            async with limit:
                start = time.perf_counter()
                if isinstance(case, RestCase):
                    result = await rest_call(client, case, timeout)
                else:
                    result = await grpc_call(stub, channel, case, timeout)
                transport = "rest" if isinstance(case, RestCase) else "grpc"
                outcomes.append(Outcome(transport, case.valid, case.kind, *result[:2],
                                        time.perf_counter() - start, result[2]))

        await asyncio.gather(*(one(c) for c in cases))
    return outcomes


def make_cases(target: Target, valid: int, malformed: int, seed: int, max_tokens: int) -> list:
    """`valid` and `malformed` requests, each half REST and half gRPC, shuffled together."""
    c = Cases(target, seed, max_tokens)
    cases = [c.rest_valid() if i % 2 == 0 else c.grpc_valid() for i in range(valid)]
    cases += [c.rest_malformed() if i % 2 == 0 else c.grpc_malformed() for i in range(malformed)]
    random.Random(seed).shuffle(cases)
    return cases


def summarize(outcomes: list[Outcome]) -> dict:
    groups: dict[str, Counter] = defaultdict(Counter)
    seconds: dict[str, list[float]] = defaultdict(list)
    statuses: dict[str, Counter] = defaultdict(Counter)
    kinds: Counter = Counter()
    for o in outcomes:
        group = f"{o.transport}/{'valid' if o.valid else 'malformed'}"
        groups[group]["sent"] += 1
        groups[group][o.result] += 1
        seconds[group].append(o.seconds)
        statuses[o.transport][o.status] += 1
        kinds[o.kind] += 1
    totals = {f: sum(1 for o in outcomes if o.result == f) for f in FAILURES}
    return {
        "requests": len(outcomes),
        "totals": totals,
        "groups": {g: {**{k: 0 for k in ("sent", "served", "refused", *FAILURES)}, **dict(c)}
                   for g, c in sorted(groups.items())},
        "latency_ms": {g: {"p50": percentile(s, 50) * 1e3, "p99": percentile(s, 99) * 1e3, "max": max(s) * 1e3}
                       for g, s in sorted(seconds.items())},
        "statuses": {t: dict(c.most_common()) for t, c in sorted(statuses.items())},
        "kinds": dict(sorted(kinds.items())),
        # Malformed requests a server took: not failures, but a check the mutations bite.
        "malformed_served": sorted({o.kind for o in outcomes if not o.valid and o.result == "served"}),
        "failures": [vars(o) for o in outcomes if o.result in FAILURES][:30],
        # Valid requests refused (a 4xx): allowed (a context overrun, say), listed to check why.
        "valid_refused": Counter(re.sub(r"\d+", "N", o.detail[:160])
                                 for o in outcomes if o.valid and o.result == "refused").most_common(10),
    }


def _print(report: dict) -> None:
    print(f"\n{report['requests']} requests in {report['elapsed_s']:.1f} s "
          f"(concurrency {report['concurrency']}, deadline {report['timeout_s']:g} s)\n")
    rows = [[group, *(c[k] for k in ("sent", "served", "refused", *FAILURES)),
             *(f"{report['latency_ms'][group][p]:.0f} ms" for p in ("p50", "p99"))]
            for group, c in report["groups"].items()]
    print(markdown_table(("group", "sent", "served", "refused (4xx)", "hangs", "server errors", "lost",
                          "bad error shape", "p50", "p99"), rows))
    t = report["totals"]
    print(f"\nhangs {t['hang']}, server errors {t['server_error']}, lost {t['lost']}, "
          f"bad error shapes {t['bad_error_shape']}")
    for f in report["failures"][:10]:
        print(f"  {f['transport']} {f['kind']}: {f['result']} {f['status']} {f['detail'][:120]}")


# -- targets ---------------------------------------------------------------------------

def _describe(url: str, api_key: str | None, model_path: Path | None) -> Target:
    """The running gateway's model, context and vocabulary (from /v1/models and the tokenizer)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]
    vocab = 32000
    if model_path is not None:
        from tessera.text import load_tokenizer

        vocab = len(load_tokenizer(str(model_path)))
    return Target(models["id"], api_key, models["max_model_len"], vocab)


def _fuzz(args: argparse.Namespace, url: str, grpc_address: str, api_key: str | None,
          model_path: Path | None) -> dict:
    target = _describe(url, api_key, model_path)
    cases = make_cases(target, args.valid, args.malformed, args.seed, args.max_tokens)
    start = time.perf_counter()
    outcomes = asyncio.run(run_cases(cases, url, grpc_address, args.concurrency, args.timeout))
    report = summarize(outcomes)
    report.update(elapsed_s=time.perf_counter() - start, concurrency=args.concurrency, timeout_s=args.timeout,
                  seed=args.seed, target={"url": url, "grpc": grpc_address, "model": target.model,
                                          "max_model_len": target.max_model_len})
    return report


def _own_platform(args: argparse.Namespace, work: Path):
    """Two engine pods and a gateway with one tenant key, on loopback."""
    import contextlib
    import secrets

    import yaml

    from engine_pod.server.process import EnginePodProcess
    from gateway.process import GatewayProcess
    from gateway.tenants import hash_api_key

    model = resolve_model(args.model)
    key = "sk-fuzz-" + secrets.token_urlsafe(16)
    (work / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [{"name": "fuzz",
                                                                     "api_key_sha256": [hash_api_key(key)]}]}))
    pod_args = ["--max-model-len", str(args.max_model_len), "--cpu-threads", "1", "--dtype", args.dtype]
    stack = contextlib.ExitStack()
    pods = [stack.enter_context(EnginePodProcess(model, pod_args, log_path=work / f"pod-{i}.log"))
            for i in range(args.pods)]
    for pod in pods:
        pod.wait_serving()
    config = {"model": {"name": "tiny", "path": str(model), "max_model_len": args.max_model_len},
              "pods": {"static": [{"address": p.address, "role": "mixed"} for p in pods]},
              "tenants_file": str(work / "tenants.yaml")}
    gw = stack.enter_context(GatewayProcess(config, work, log_path=work / "gateway.log"))
    gw.wait_ready(num_pods=args.pods)
    return stack, gw, key, model


def main(args: argparse.Namespace) -> int:
    if args.url:
        if not args.grpc:
            raise SystemExit("--url needs --grpc (the gateway's gRPC address)")
        report = _fuzz(args, args.url.rstrip("/"), args.grpc, os.environ.get(API_KEY_ENV) or None,
                       Path(args.model) if args.model else None)
    else:
        with work_dir(args.logs, "tessera-bench-fuzz-") as work:
            stack, gw, key, model = _own_platform(args, work)
            with stack:
                report = _fuzz(args, gw.base_url, gw.grpc_address, key, model)
                report["gateway_alive"] = gw.proc.poll() is None
    _print(report)
    write_report(report, args.output)
    failed = any(report["totals"].values()) or not report.get("gateway_alive", True)
    return 1 if failed else 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("fuzz", help="valid and malformed requests over REST and gRPC: hangs, 5xx, lost requests")
    p.add_argument("--url", default=None, help=f"a running gateway's REST base URL (default: start a platform); "
                                               f"its API key from ${API_KEY_ENV}, if it needs one")
    p.add_argument("--grpc", default=None, help="with --url: the gateway's gRPC address (host:port)")
    add_model_args(p, default_tiny=True, model_help="checkpoint folder (default: the tiny preset); with --url, "
                                                   "read for the vocabulary size")
    p.add_argument("--valid", type=non_negative_int, default=1000, help="valid requests (half REST, half gRPC)")
    p.add_argument("--malformed", type=non_negative_int, default=1000, help="malformed requests (half REST, half gRPC)")
    p.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight at once")
    p.add_argument("--timeout", type=positive_float, default=60.0, help="seconds before a request counts as hung")
    p.add_argument("--max-tokens", type=positive_int, default=4, help="largest max_tokens of a valid request")
    p.add_argument("--max-model-len", type=positive_int, default=48, help="the started platform's context")
    p.add_argument("--pods", type=positive_int, default=2, help="engine pods of the started platform")
    add_seed_arg(p)
    add_logs_arg(p)
    add_output_arg(p, default="bench-results/fuzz.json")
    p.set_defaults(bench_func=main)
