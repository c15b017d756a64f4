"""``tessera operator``'s command line: light on purpose (no kopf, no kubernetes client), so
`tessera operator --help` answers at once; the operator itself (main.py) loads when it runs."""

from __future__ import annotations

import argparse
import os

# The chart sets it from the downward API (metadata.namespace of the operator's pod).
OPERATOR_NAMESPACE_ENV = "TESSERA_OPERATOR_NAMESPACE"
# Seconds between autoscaling and drift-correction passes (the handlers' timer).
DEFAULT_INTERVAL_S = 15.0


def add_parser(sub) -> None:
    p = sub.add_parser("operator", help="run the Kubernetes operator that reconciles InferenceServices")
    scope = p.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", dest="namespaces", metavar="NAMESPACE",
                       help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    p.add_argument("--liveness-port", type=int, default=8080, help="serve GET /healthz here (0: off)")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S,
                   help="seconds between autoscaling and drift-correction passes")
    p.add_argument("--operator-namespace", default=os.environ.get(OPERATOR_NAMESPACE_ENV) or None,
                   help="the namespace the operator runs in: NetworkPolicies admit its pods to the metrics "
                        f"ports (default: ${OPERATOR_NAMESPACE_ENV})")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from tessera_operator.main import serve

    return serve(args)
