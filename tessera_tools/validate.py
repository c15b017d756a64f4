"""``tessera validate -f FILE``: check InferenceServices against the CRD and the operator's rules,
off-cluster (a CI step, a pre-commit hook, before `kubectl apply`)."""

from __future__ import annotations

import argparse

from tessera_operator.schema_check import check, crd_schema
from tessera_tools.resource_files import Document, read_documents

HELP = "check InferenceService files against the CRD schema and the operator's rules"


def add_parser(sub) -> None:
    p = sub.add_parser("validate", help=HELP, description=HELP + ". Exit status: 0 valid, 1 invalid, 2 unreadable.")
    p.add_argument("-f", "--filename", action="append", required=True, metavar="FILE", dest="files",
                   help="a YAML file of one or more InferenceServices ('-': standard input); repeatable")
    p.add_argument("--crd", metavar="CRD_FILE",
                   help="check against this CRD manifest (e.g. the installed chart's "
                        "crds/inferenceservices.tessera.dev.yaml) instead of this version's schema")
    p.set_defaults(func=_cmd_validate)


def problems(doc: Document, openapi: dict | None = None) -> list[str]:
    """`SOURCE: path: message` for each problem of one document (none: valid)."""
    return [f"{doc.source}: {error}" for error in check(doc.body, openapi)]


def _crd_openapi(path: str) -> dict:
    try:
        return crd_schema(read_documents(path)[0].body)
    except (ValueError, KeyError, TypeError) as e:
        message = str(e)
        raise ValueError(message if message.startswith(path) else f"{path}: {message}") from None


def _cmd_validate(args: argparse.Namespace) -> int:
    openapi = _crd_openapi(args.crd) if args.crd else None
    docs = [doc for path in args.files for doc in read_documents(path)]
    invalid = 0
    for doc in docs:
        found = problems(doc, openapi)
        invalid += bool(found)
        print("\n".join(found) if found else f"{doc.source}: valid")
    return 1 if invalid else 0
