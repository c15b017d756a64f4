"""Two images: engine pods run the engine image (torch), the gateway the slim control-plane one.

The Dockerfile's `engine` and `control-plane` targets build them. A custom spec.image (a mirror,
one's own build) still serves both, as when there was one image: the engine image holds the gateway.
"""

from __future__ import annotations

from tessera_operator.crd_spec import DEFAULT_CONTROL_PLANE_IMAGE, DEFAULT_IMAGE
from tessera_operator.reconcile import desired_objects

from .conftest import make_isvc


def images(body: dict) -> dict[str, str]:
    """Deployment name -> the image of its container."""
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["image"]
            for o in desired_objects(body) if o["kind"] == "Deployment"}


def test_defaults_put_the_gateway_on_the_slim_image():
    assert images(make_isvc()) == {"llama-gateway": DEFAULT_CONTROL_PLANE_IMAGE, "llama-engine": DEFAULT_IMAGE}
    assert images(make_isvc({"mode": "disaggregated"})) == {
        "llama-gateway": DEFAULT_CONTROL_PLANE_IMAGE, "llama-prefill": DEFAULT_IMAGE, "llama-decode": DEFAULT_IMAGE}


def test_a_custom_engine_image_serves_the_gateway_too():
    assert images(make_isvc({"image": "registry.local/tessera:dev"})) == {
        "llama-gateway": "registry.local/tessera:dev", "llama-engine": "registry.local/tessera:dev"}


def test_gateway_image_wins():
    for spec in ({}, {"image": "registry.local/tessera:dev"}):
        body = make_isvc({**spec, "gateway": {"image": "registry.local/tessera-control-plane:dev"}})
        assert images(body)["llama-gateway"] == "registry.local/tessera-control-plane:dev"
        assert images(body)["llama-engine"] == spec.get("image", DEFAULT_IMAGE)


def test_both_images_take_the_pull_policy():
    objects = desired_objects(make_isvc({"imagePullPolicy": "Always"}))
    policies = {o["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"]
                for o in objects if o["kind"] == "Deployment"}
    assert policies == {"Always"}
