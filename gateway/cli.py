"""The gateway's subcommands of `tessera` (`gateway`, `api-key`): their
argument parsers only, light to import, so `tessera gateway --help` answers
at once; the gateway itself (gateway/main.py) is imported when it runs."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("gateway", help="run the gateway (REST + gRPC tessera.v1.Inference)")
    p.add_argument("--config", required=True, help="gateway YAML (see docs/gateway.md)")
    p.add_argument("--host", default=None, help="override server.host")
    p.add_argument("--http-port", type=int, default=None, help="override server.http_port")
    p.add_argument("--grpc-port", type=int, default=None, help="override server.grpc_port")
    p.add_argument("--metrics-port", type=int, default=None, help="override server.metrics_port (0: none)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    p.set_defaults(func=_run_gateway)


def add_api_key_parser(sub) -> None:
    p = sub.add_parser("api-key", help="make a new tenant API key and its tenants-file entry")
    p.add_argument("--tenant", required=True, help="tenant name for the printed entry")
    p.set_defaults(func=_new_api_key)


def _run_gateway(args: argparse.Namespace) -> int:
    from tessera.text.torch_free import hide_torch_from_transformers

    # The gateway tokenizes with transformers, which would import torch
    # (installed for the engine) for nothing: first thing, before it loads.
    hide_torch_from_transformers()
    from gateway.main import run

    return run(args)


def _new_api_key(args: argparse.Namespace) -> int:
    import secrets

    import yaml

    from gateway.tenants import hash_api_key

    key = "sk-tessera-" + secrets.token_urlsafe(32)
    print(f"# API key (give it to the tenant; it is not stored anywhere): {key}")
    print(yaml.safe_dump({"tenants": [{"name": args.tenant, "api_key_sha256": [hash_api_key(key)]}]},
                         sort_keys=False), end="")
    return 0
