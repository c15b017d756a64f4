"""The Dockerfile: two targets, one per install of pyproject.toml, from one copy of the sources.

`engine` is engine pods' image (torch from TORCH_INDEX_URL first, g++, `.[engine]`);
`control-plane` the gateway's and the operator's (`pip install .`: no torch, no compiler).
No docker here: the file is read as text, stage by stage. A forgotten COPY breaks only the image.
"""

from __future__ import annotations

import re
import tomllib

from setuptools import find_packages

from tessera_operator import pod_parts

from .conftest import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()


def stages() -> dict[str, tuple[str, str]]:
    """Stage name -> (the stage it is FROM, its instructions), comments and blank lines dropped."""
    out: dict[str, tuple[str, str]] = {}
    name = ""
    for line in DOCKERFILE.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.match(r"FROM (\S+) AS (\S+)$", line)
        if m:
            name = m.group(2)
            out[name] = (m.group(1), "")
        else:
            parent, body = out[name]
            out[name] = (parent, body + line + "\n")
    return out


def lineage(name: str) -> str:
    """The instructions of a stage and of every stage it builds on, oldest first."""
    parent, body = stages()[name]
    return (lineage(parent) if parent in stages() else "") + body


def test_dockerfile_copies_every_package_folder():
    copied = set(re.findall(r"^COPY (\S+?)/ ", stages()["source"][1], flags=re.M))
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    folders = set()
    for where in find["where"]:
        for package in find_packages(str(REPO / where), include=find["include"]):
            # A package under a `where` folder other than "." comes from that folder.
            folders.add(package.split(".")[0] if where == "." else where)
    assert {"tessera", "tessera_tools", "engine_pod", "kv_store", "gateway", "operator"} <= folders
    assert folders <= copied


def test_two_targets_install_from_the_one_copy():
    all_stages = stages()
    assert {"engine", "control-plane"} <= set(all_stages)
    assert all_stages["source"][0] == "scratch"
    for target in ("engine", "control-plane"):
        assert "COPY --from=source /src/ /opt/tessera/" in all_stages[target][1]
    # A bare `docker build .` still gives the engine image, the one image there used to be.
    assert list(all_stages)[-1] == "engine"


def test_control_plane_has_no_torch_and_no_compiler():
    text = lineage("control-plane")
    assert re.search(r"^RUN pip install \. ", text, flags=re.M)
    assert "torch" not in text.lower() and "g++" not in text and "[engine]" not in text


def test_engine_installs_torch_first_then_the_engine_extra():
    text = lineage("engine")
    torch = text.index('pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"')
    sources = text.index("COPY --from=source")
    package = text.index('RUN pip install ".[engine]"')
    # torch's layer comes before the sources: a code change does not download it again.
    assert torch < sources < package
    assert "g++" in text
    assert re.search(r"^ARG TORCH_INDEX_URL=", text, flags=re.M)


def test_both_images_run_the_cli_as_non_root():
    for target in ("engine", "control-plane"):
        text = lineage(target)
        assert text.rstrip().endswith('ENTRYPOINT ["tessera"]\nCMD ["--help"]'), target
        # The chart's and the operator's runAsUser; no RUN after it (installs need root).
        assert f"useradd --uid {pod_parts.RUN_AS_USER} " in text
        after = text.split(f"USER {pod_parts.RUN_AS_USER}\n")
        assert len(after) == 2 and "RUN " not in after[1], target
