"""``tessera render -f FILE``: the manifests the operator would create for an InferenceService, as one
YAML stream for `kubectl apply -f -` or a GitOps repository (tessera_operator/render.py)."""

from __future__ import annotations

import argparse
import sys

from tessera_operator.render import render_stream
from tessera_tools.resource_files import read_documents
from tessera_tools.validate import problems

HELP = "print the Kubernetes objects the operator would create for an InferenceService"


def add_parser(sub) -> None:
    p = sub.add_parser("render", help=HELP, description=HELP + " (a multi-document YAML stream). The internal "
                       "Secret is left out: the operator generates it. Exit status: 0 rendered, 1 invalid, "
                       "2 unreadable.")
    p.add_argument("-f", "--filename", required=True, metavar="FILE",
                   help="a YAML file of one or more InferenceServices ('-': standard input)")
    p.add_argument("-n", "--namespace",
                   help="render into this namespace (default: the resource's metadata.namespace, else default)")
    p.add_argument("--operator-namespace", metavar="NAMESPACE",
                   help="the namespace the operator runs in, as its --operator-namespace: the NetworkPolicies "
                        "admit its pods to the metrics ports (default: none)")
    p.add_argument("-o", "--output", metavar="OUT", help="write the stream to this file (default: standard output)")
    p.set_defaults(func=_cmd_render)


def _cmd_render(args: argparse.Namespace) -> int:
    docs = read_documents(args.filename)
    found = [line for doc in docs for line in problems(doc)]
    if found:
        # Nothing rendered: half a deployment applied is worse than none.
        print("\n".join(found), file=sys.stderr)
        return 1
    text = "".join(render_stream(doc.body, doc.source, args.namespace, args.operator_namespace) for doc in docs)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
