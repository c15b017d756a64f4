"""`tessera bench fuzz` at a tiny size against the fuzzing gateway: it runs,
reaches both transports with valid and malformed requests, and finds no
hang, server error, lost request or bad error shape."""

from __future__ import annotations

import json

from tessera_tools.cli import build_parser
from tests.gateway.conftest import KEYS


def test_bench_fuzz_tiny_run(fuzz_gateway, tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "fuzz.json"
    monkeypatch.setenv("OPENAI_API_KEY", KEYS["fuzz"])  # never on the command line
    args = build_parser().parse_args([
        "bench", "fuzz", "--url", fuzz_gateway.base_url, "--grpc", fuzz_gateway.grpc_address,
        "--model", str(tiny_llama), "--valid", "40", "--malformed", "80",
        "--concurrency", "8", "--timeout", "30", "--output", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["totals"] == {"hang": 0, "server_error": 0, "lost": 0, "bad_error_shape": 0}
    groups = report["groups"]
    assert {g: c["sent"] for g, c in groups.items()} == {
        "grpc/malformed": 40, "grpc/valid": 20, "rest/malformed": 40, "rest/valid": 20}
    # The two sides are told apart: valid requests served, malformed ones refused.
    for transport in ("rest", "grpc"):
        assert groups[f"{transport}/valid"]["served"] >= 15
        assert groups[f"{transport}/malformed"]["refused"] >= 35
    assert fuzz_gateway.proc.poll() is None
