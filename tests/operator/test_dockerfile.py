"""The Dockerfile installs every package pyproject.toml ships (a forgotten COPY breaks only the image)."""

from __future__ import annotations

import re
import tomllib

from setuptools import find_packages

from .conftest import REPO


def test_dockerfile_copies_every_package_folder():
    copied = set(re.findall(r"^COPY (\S+?)/ ", (REPO / "Dockerfile").read_text(), flags=re.M))
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    folders = set()
    for where in find["where"]:
        for package in find_packages(str(REPO / where), include=find["include"]):
            # A package under a `where` folder other than "." comes from that folder.
            folders.add(package.split(".")[0] if where == "." else where)
    assert {"tessera", "engine_pod", "kv_store", "operator"} <= folders
    assert folders <= copied


def test_image_runs_the_cli_as_non_root():
    text = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tessera"]' in text
    assert re.search(r"^USER 10001$", text, flags=re.M)  # the chart's runAsUser
