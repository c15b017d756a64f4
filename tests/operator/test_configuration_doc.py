"""docs/configuration.md documents exactly the CRD's fields, with the schema's defaults.

The page is read as a reader sees it (its `| Field | ...` tables), and the schema is
walked here on its own, so a bug in the generator (tessera_operator.config_doc) cannot
hide a missing or extra field.
"""

from __future__ import annotations

import itertools
import re

import pytest
import yaml

from tessera_operator import config_doc, crd, validate_inference_service

from .conftest import REPO

DOC = REPO / "docs" / "configuration.md"
NO_DEFAULT = {"—", "required"}


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def _cells(line: str) -> list[str]:
    """Cells of a markdown table row; `\\|` is a pipe inside a cell."""
    inner = line.strip()[1:-1]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def _code(cell: str) -> str | None:
    m = re.fullmatch(r"`([^`]*)`", cell)
    return m.group(1) if m else None


def _expand(path: str) -> list[str]:
    """`a.{x,y}.b` -> [`a.x.b`, `a.y.b`]."""
    pieces = re.split(r"\{([^}]*)\}", path)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(pieces)]
    return ["".join(combo) for combo in itertools.product(*options)]


def documented_fields(text: str) -> dict[str, str]:
    """Each documented path (braces expanded) -> its Default cell."""
    rows: dict[str, str] = {}
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = cells
            continue
        if header[:3] != ["Field", "Type", "Default"] or set(line) <= set("|-: "):
            continue
        path = _code(cells[0])
        assert path, f"a field table row without a `path`: {line}"
        for p in _expand(path):
            assert p not in rows, f"{p} is documented twice"
            rows[p] = cells[2]
    return rows


def schema_fields() -> dict[str, tuple[dict, bool]]:
    """Every field path of the CRD schema -> (its schema, required by its parent)."""
    out: dict[str, tuple[dict, bool]] = {}

    def walk(node: dict, prefix: str) -> None:
        required = set(node.get("required", []))
        for key, sub in node.get("properties", {}).items():
            path = f"{prefix}{key}"
            out[path] = (sub, key in required)
            walk(sub, path + ".")
            if sub.get("type") == "array" and "properties" in sub.get("items", {}):
                walk(sub["items"], path + "[].")

    walk(crd.openapi_schema(), "")
    return out


def test_every_schema_field_is_documented_and_nothing_else():
    documented = set(documented_fields(doc_text()))
    schema = set(schema_fields())
    assert sorted(schema - documented) == [], "fields of the CRD schema missing from docs/configuration.md"
    assert sorted(documented - schema) == [], "fields in docs/configuration.md that the CRD schema lacks"


def test_documented_defaults_are_the_schemas():
    schema = schema_fields()
    for path, cell in documented_fields(doc_text()).items():
        node, required = schema[path]
        if "default" in node:
            value = _code(cell)
            assert value is not None, f"{path}: documented default {cell!r}, schema default {node['default']!r}"
            assert yaml.safe_load(value) == node["default"], f"{path}: {value!r} != {node['default']!r}"
        else:
            assert cell == ("required" if required else "—"), f"{path}: schema has no default, doc says {cell!r}"


def test_page_is_generated_from_the_current_schema():
    text = doc_text()
    assert config_doc.render(text) == text, "run `python -m tessera_operator.config_doc`"


def test_every_field_has_a_description():
    missing = [p for p, (node, _) in schema_fields().items()
               if not node.get("description") and p not in config_doc.FALLBACK_DESCRIPTIONS]
    assert missing == [], "add descriptions in crd_spec.py or crd_engine.py (kubectl explain and the docs show them)"


def _example_resources(text: str) -> list[dict]:
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return [obj for obj in map(yaml.safe_load, blocks) if isinstance(obj, dict) and obj.get("kind") == crd.KIND]


def test_examples_on_the_page_validate():
    examples = _example_resources(doc_text())
    assert len(examples) >= 2
    for obj in examples:
        validate_inference_service(obj)


@pytest.mark.parametrize("bad", [
    "<!-- fields:begin spec.nope -->\n<!-- fields:end -->\n",
    "<!-- fields:begin spec.model -->\n",
    "<!-- fields:begin . -->\n<!-- fields:end -->\n<!-- fields:end -->\n",
    "<!-- fields:begin spec -->\n<!-- fields:end -->\n",  # status is in no block
])
def test_generator_rejects_broken_pages(bad):
    with pytest.raises(ValueError):
        config_doc.render(bad)


def test_generator_keeps_prose_and_check_mode(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    page.write_text("# Title\n\nProse.\n\n<!-- fields:begin . -->\nold table\n<!-- fields:end -->\n\nMore prose.\n")
    assert config_doc.main([str(page), "--check"]) == 1
    assert config_doc.main([str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Title\n\nProse.\n\n<!-- fields:begin . -->\n| Field |")
    assert text.endswith("<!-- fields:end -->\n\nMore prose.\n")
    assert "old table" not in text and "`spec.engine.blockSize`" in text
    assert config_doc.main([str(page), "--check"]) == 0
