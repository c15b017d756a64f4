"""Reading the YAML files `tessera render` and `tessera validate` take: every document, or a clear error."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import yaml


@dataclass(frozen=True)
class Document:
    """One YAML document of a file."""

    source: str
    """Where it came from, as messages name it: the file, with `#N` when the file holds several."""
    body: Any
    """The parsed document (a mapping when it is a resource)."""


def read_documents(path: str) -> list[Document]:
    """The non-empty documents of `path` ("-": standard input); ValueError naming the file and
    line when it cannot be read or is not YAML."""
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    try:
        bodies = [body for body in yaml.safe_load_all(text) if body is not None]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ValueError(f"{path}: not valid YAML{where}: {problem}") from None
    if not bodies:
        raise ValueError(f"{path}: holds no YAML document")
    if len(bodies) == 1:
        return [Document(path, bodies[0])]
    return [Document(f"{path}#{i}", body) for i, body in enumerate(bodies, 1)]
