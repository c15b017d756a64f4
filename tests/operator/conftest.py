"""InferenceService bodies shared by the operator tests."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("inferenceservice-*.yaml"))
CHART = REPO / "charts" / "tessera"


def make_isvc(spec: dict | None = None, name: str = "llama", namespace: str = "ml", **meta) -> dict:
    """A minimal valid InferenceService as the API server would hand it over."""
    body = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace, "uid": "uid-1234", "generation": 1, **meta},
        "spec": {"model": {"name": "llama-8b", "pvc": {"claimName": "models", "path": "llama-8b"}}},
    }
    if spec:
        body["spec"] = deep_merge(body["spec"], spec)
    return body


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_example(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture
def isvc() -> dict:
    return make_isvc()


@pytest.fixture
def pd_isvc() -> dict:
    return make_isvc({"mode": "disaggregated"})
