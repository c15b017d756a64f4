"""The field tables of docs/configuration.md, generated from the CRD schema (crd.openapi_schema).

The page is prose written by hand with generated tables in between. Each block

    <!-- fields:begin ROOT [ROOT ...] -->
    ...generated...
    <!-- fields:end -->

is replaced by the table of the schema's fields under its roots (a field
belongs to the block with the longest root that prefixes it; the root `.`
is the whole resource), followed by the cross-field rules checked on them.
Everything outside the blocks is kept as written.

    python -m tessera_operator.config_doc            # rewrite docs/configuration.md
    python -m tessera_operator.config_doc --check    # exit 1 if it is stale

Paths: `spec.engine.blockSize`; `[]` marks the items of a list
(`spec.gateway.priorityClasses[].name`); siblings with identical schemas are
one row, their keys in braces (`spec.pools.{mixed,prefill,decode}.replicas`).
Maps (labels, resource lists) are one row: their keys are free.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tessera_operator import crd
from tessera_operator.schema_dsl import QUANTITY_PATTERN, SIZE_PATTERN, Schema

DOC = Path("docs/configuration.md")
BEGIN = re.compile(r"^<!-- fields:begin (?P<roots>[^>]+?) -->$", re.M)
END = "<!-- fields:end -->"
END_LINE = re.compile(r"^<!-- fields:end -->$", re.M)
WHOLE = "."
HEADER = ("Field", "Type", "Default", "Values", "Description")
# The quantity patterns (schema_dsl) say "a Kubernetes quantity": the type column names it, the regex is noise.
QUANTITY_PATTERNS = (QUANTITY_PATTERN, SIZE_PATTERN)
# Kubernetes' own field: the CRD gives only its type and leaves the rest to the API server.
FALLBACK_DESCRIPTIONS = {"metadata": "Standard object metadata: name, namespace, labels, annotations."}


@dataclass(frozen=True)
class Field:
    path: str
    schema: Schema
    required: bool

    @property
    def description(self) -> str:
        text = self.schema.get("description") or FALLBACK_DESCRIPTIONS.get(self.path)
        if not text:
            raise ValueError(f"{self.path}: the schema has no description "
                             "(add one in crd_spec.py, crd_engine.py or crd_lora.py)")
        return text


def schema_fields(schema: Schema | None = None) -> list[Field]:
    """Every field of the resource, in schema order (the root itself is not a field)."""
    out: list[Field] = []
    _walk(schema if schema is not None else crd.openapi_schema(), "", out)
    return out


def _walk(node: Schema, path: str, out: list[Field]) -> None:
    props: dict[str, Schema] = node.get("properties", {})
    required = set(node.get("required", []))
    children: list[tuple[str, Schema, bool]]
    values = list(props.values())
    if len(values) > 1 and all(v == values[0] for v in values[1:]):
        keys = "{" + ",".join(props) + "}"
        children = [(keys, values[0], bool(required & set(props)))]
    else:
        children = [(key, sub, key in required) for key, sub in props.items()]
    for key, sub, req in children:
        child = f"{path}.{key}" if path else key
        out.append(Field(child, sub, req))
        _walk(sub, child, out)
        items = sub.get("items")
        if sub.get("type") == "array" and isinstance(items, dict) and "properties" in items:
            _walk(items, child + "[]", out)


def _under(path: str, root: str) -> bool:
    return root == WHOLE or path == root or path.startswith(root + ".") or path.startswith(root + "[]")


def _owner(path: str, roots: list[str]) -> str | None:
    matches = [r for r in roots if _under(path, r)]
    return max(matches, key=lambda r: -1 if r == WHOLE else len(r)) if matches else None


# -- rendering -----------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _no_tags(text: str) -> str:
    """Markdown text: a `<` outside code spans would start an HTML tag."""
    parts = text.split("`")
    parts[::2] = [p.replace("<", "&lt;") for p in parts[::2]]
    return "`".join(parts)


def _code(text: str) -> str:
    return _cell(f"`{text}`")


def format_value(value: Any) -> str:
    """A value as YAML that reads back to itself (the test parses it)."""
    if isinstance(value, str):
        return value if value and yaml.safe_load(value) == value else json.dumps(value)
    if isinstance(value, (dict, list)):
        return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip()
    return json.dumps(value)


def type_name(schema: Schema) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "quantity" if schema.get("pattern") in QUANTITY_PATTERNS else "int or string"
    kind = schema.get("type", "")
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map[string]{type_name(schema['additionalProperties'])}"
    if kind == "array":
        return f"[]{type_name(schema['items'])}"
    return kind


def values_text(schema: Schema) -> str:
    parts: list[str] = []
    if "enum" in schema:
        parts.append(", ".join(_code(format_value(v)) for v in schema["enum"]))
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if lo is not None and hi is not None:
        parts.append(f"{format_value(lo)} to {format_value(hi)}")
    elif lo is not None:
        parts.append(f"≥ {format_value(lo)}")
    elif hi is not None:
        parts.append(f"≤ {format_value(hi)}")
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is not None and hi is not None:
        parts.append(f"{lo} to {hi} characters")
    elif lo is not None:
        parts.append(f"at least {lo} character{'s' if lo > 1 else ''}")
    elif hi is not None:
        parts.append(f"at most {hi} characters")
    if "pattern" in schema and schema["pattern"] not in QUANTITY_PATTERNS:
        parts.append(f"matches {_code(schema['pattern'])}")
    if "maxItems" in schema:
        parts.append(f"at most {schema['maxItems']} items")
    if schema.get("x-kubernetes-list-map-keys"):
        parts.append("unique " + ", ".join(_code(k) for k in schema["x-kubernetes-list-map-keys"]))
    return "; ".join(parts)


def _default_text(f: Field) -> str:
    if "default" in f.schema:
        return _code(format_value(f.schema["default"]))
    return "required" if f.required else "—"


def _row(f: Field) -> str:
    cells = [_code(f.path), _code(type_name(f.schema)), _default_text(f), values_text(f.schema),
             _cell(_no_tags(f.description))]
    return "| " + " | ".join(cells) + " |"


def _rules(root_schema: Schema, fields: list[Field], roots: list[str]) -> list[str]:
    lines = []
    nodes = [("", root_schema)] if WHOLE in roots else []
    for f in fields:
        nodes.append((f.path, f.schema))
        if f.schema.get("type") == "array" and isinstance(f.schema.get("items"), dict):
            nodes.append((f.path + "[]", f.schema["items"]))  # rules on each item of a list
    for path, node in nodes:
        for rule in node.get("x-kubernetes-validations", []):
            where = f"`{path}`" if path else "the resource"
            lines.append(f"- On {where}: {_no_tags(rule['message'])} (CEL: `{rule['rule']}`).")
    return lines


def render_block(roots: list[str], all_roots: list[str], schema: Schema | None = None) -> str:
    root_schema = schema if schema is not None else crd.openapi_schema()
    fields = [f for f in schema_fields(root_schema) if _owner(f.path, all_roots) in roots]
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += [_row(f) for f in fields]
    rules = _rules(root_schema, fields, roots)
    if rules:
        lines += ["", "Checked across fields:", "", *rules]
    return "\n".join(lines)


def _blocks(text: str) -> list[tuple[re.Match, int]]:
    """Each begin marker with the offset of its end marker."""
    out = []
    for m in BEGIN.finditer(text):
        end = END_LINE.search(text, m.end())
        nxt = BEGIN.search(text, m.end())
        if end is None or (nxt is not None and nxt.start() < end.start()):
            raise ValueError(f"`{m.group(0)}` has no `{END}` line before the next block")
        out.append((m, end.start()))
    if len(END_LINE.findall(text)) != len(out):
        raise ValueError(f"a `{END}` line without its begin marker")
    return out


def render(text: str, schema: Schema | None = None) -> str:
    """The page with every fields block regenerated; the prose around them unchanged."""
    root_schema = schema if schema is not None else crd.openapi_schema()
    blocks = _blocks(text)
    block_roots = [m.group("roots").split() for m, _ in blocks]
    all_roots = [r for roots in block_roots for r in roots]
    if len(set(all_roots)) != len(all_roots):
        raise ValueError(f"a root appears in two blocks: {all_roots}")
    paths = {f.path for f in schema_fields(root_schema)}
    unknown = [r for r in all_roots if r != WHOLE and r not in paths]
    if unknown:
        raise ValueError(f"blocks name fields the schema lacks: {unknown}")
    orphans = [p for p in sorted(paths) if _owner(p, all_roots) is None]
    if orphans:
        raise ValueError(f"fields in no block (add a block, or a `{WHOLE}` block): {orphans}")
    out, pos = [], 0
    for (m, end), roots in zip(blocks, block_roots):
        out += [text[pos:m.end()], "\n", render_block(roots, all_roots, root_schema), "\n"]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera_operator.config_doc", description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", type=Path, default=DOC, help=f"the page (default {DOC})")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from its regeneration")
    args = parser.parse_args(argv)
    text = args.path.read_text(encoding="utf-8")
    fresh = render(text)
    if args.check:
        if fresh != text:
            print(f"{args.path} is stale: run `python -m tessera_operator.config_doc`", file=sys.stderr)
            return 1
        print(f"{args.path} is up to date")
        return 0
    if fresh != text:
        args.path.write_text(fresh, encoding="utf-8")
        print(f"wrote {args.path}")
    else:
        print(f"{args.path} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
