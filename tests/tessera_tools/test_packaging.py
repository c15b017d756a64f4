"""pyproject.toml's extras against what each layer imports (read with ast, nothing imported).

The plain install is the control plane (gateway, operator, the base and the KV store modules
they use, the `tessera` command itself): no torch. `engine` adds what engine pods need, `tools`
what the CLI's local tools and benchmarks need, `test` everything.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Our import roots and their folders.
OURS = {"tessera": REPO / "tessera", "kv_store": REPO / "kv_store", "engine_pod": REPO / "engine_pod",
        "gateway": REPO / "gateway", "tessera_operator": REPO / "operator" / "tessera_operator",
        "tessera_tools": REPO / "tessera_tools"}
ENGINE_ONLY = {"torch", "triton", "xgrammar", "safetensors", "ninja"}
# Import name (the longest dotted prefix wins) -> the distribution pyproject.toml lists for it;
# a name not here is its own distribution.
DISTRIBUTIONS = {
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "google.protobuf": "protobuf",
    "yaml": "pyyaml",
    "opentelemetry": "opentelemetry-api",
    "opentelemetry.sdk": "opentelemetry-sdk",
    "opentelemetry.exporter.otlp.proto.grpc": "opentelemetry-exporter-otlp-proto-grpc",
}
# Imported for their types but installed by the distribution named: part of its API.
VIA = {"pydantic": "fastapi", "starlette": "fastapi"}


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower().replace("_", "-")


def _listed(*extras: str) -> set[str]:
    names = {_name(r) for r in PROJECT["dependencies"]}
    for extra in extras:
        names |= {_name(r) for r in PROJECT["optional-dependencies"][extra] if not r.startswith("tessera[")}
    return names


def _module_file(module: str) -> Path | None:
    root, *rest = module.split(".")
    if root not in OURS:
        return None
    base = OURS[root].joinpath(*rest)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(path: Path, module: str, top_level_only: bool) -> set[str]:
    """Dotted names `path` imports (with `from X import Y` also as X.Y, in case Y is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(parent + ([source] if source else []))
            out.add(source)
            out |= {f"{source}.{a.name}" for a in node.names}
    return out


def third_party(start: list[str], top_level_only: bool = False) -> dict[str, str]:
    """Non-stdlib dotted imports reachable from the `start` modules through ours -> a module importing it."""
    seen: set[str] = set()
    todo = list(start)
    found: dict[str, str] = {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        path = _module_file(module)
        if path is None:
            continue
        for name in _imports(path, module, top_level_only):
            root = name.split(".")[0]
            if root in OURS:
                todo.append(name)
            elif root not in sys.stdlib_module_names and name not in found:
                found[name] = module
    return found


def _package_modules(root: str) -> list[str]:
    folder = OURS[root]
    out = []
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        out.append(".".join((root, *[p for p in parts if p != "__init__"])))
    return out


def distribution(name: str) -> str:
    """The distribution pyproject.toml must list for the dotted import `name`."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in DISTRIBUTIONS:
            return DISTRIBUTIONS[prefix]
        if prefix in VIA:
            return VIA[prefix]
    return parts[0].replace("_", "-")


def _missing(imports: dict[str, str], listed: set[str]) -> dict[str, str]:
    return {name: f"{by} (needs {distribution(name)})" for name, by in sorted(imports.items())
            if distribution(name) not in listed}


CONTROL_PLANE = _package_modules("gateway") + _package_modules("tessera_operator")


def test_the_plain_install_has_no_engine_dependency():
    assert not _listed() & ENGINE_ONLY
    assert {"torch", "triton", "xgrammar", "safetensors", "ninja"} <= _listed("engine")


def test_the_control_plane_imports_only_the_plain_install():
    imports = third_party(CONTROL_PLANE)
    assert not {n.split(".")[0] for n in imports} & ENGINE_ONLY, imports
    assert _missing(imports, _listed()) == {}


def test_the_tessera_command_starts_on_the_plain_install():
    """`tessera gateway` and `tessera operator` go through tessera_tools.cli: importing it needs no extra."""
    assert PROJECT["scripts"]["tessera"] == "tessera_tools.cli:main"
    assert _missing(third_party(["tessera_tools.cli"], top_level_only=True), _listed()) == {}


def test_engine_pods_import_only_base_and_engine():
    assert _missing(third_party(_package_modules("engine_pod")), _listed("engine")) == {}


def test_tools_import_only_base_engine_and_tools():
    assert _missing(third_party(_package_modules("tessera_tools")), _listed("engine", "tools")) == {}


def test_extras_build_on_each_other():
    extras = PROJECT["optional-dependencies"]
    assert "tessera[engine]" in extras["tools"]
    # `make venv` installs the test extra: the whole suite needs every layer.
    assert "tessera[engine,tools]" in extras["test"]


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_the_name_mapping_is_what_is_installed(name):
    files = importlib.metadata.files(DISTRIBUTIONS[name]) or []
    folder = name.replace(".", "/") + "/"
    assert any(str(f).startswith(folder) for f in files), f"{DISTRIBUTIONS[name]} does not install {folder}"


@pytest.mark.parametrize("name", sorted(VIA))
def test_types_come_with_their_distribution(name):
    requires = importlib.metadata.requires(VIA[name]) or []
    assert any(_name(r) == name and "extra ==" not in r for r in requires), f"{VIA[name]} does not require {name}"
