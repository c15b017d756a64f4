"""The emulated API server itself: the API server's behaviour the operator and kopf rely on."""

from __future__ import annotations

import kmock
import pytest

from .emulator import APPLY, JSON_PATCH, ApiFailure, Emulator, selector_matches

CMS = "/api/v1/namespaces/ml/configmaps"
DEPLOYMENTS = "/apis/apps/v1/namespaces/ml/deployments"


@pytest.fixture
def api():
    with Emulator() as emulator:
        yield emulator


def test_create_stamps_metadata_and_answers_201(api):
    created = api.create(CMS, {"metadata": {"name": "a"}, "data": {"k": "v"}})
    assert api.last_status == 201
    meta = created["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1 and meta["namespace"] == "ml"
    assert api.get(f"{CMS}/a") == created
    with pytest.raises(ApiFailure) as conflict:
        api.create(CMS, {"metadata": {"name": "a"}})
    assert conflict.value.status == 409
    named = api.create("/api/v1/namespaces/ml/events", {"metadata": {"generateName": "kopf-event-"}})
    assert named["metadata"]["name"].startswith("kopf-event-")
    assert [r.url.path for r in api.requests() if r.method == "POST"] == [CMS, CMS, "/api/v1/namespaces/ml/events"]


def test_every_write_is_a_new_resource_version_and_a_no_op_is_none(api):
    v1 = api.create(CMS, {"metadata": {"name": "a"}, "data": {"k": "1"}})["metadata"]["resourceVersion"]
    v2 = api.patch(f"{CMS}/a", {"data": {"k": "2"}})["metadata"]["resourceVersion"]
    v3 = api.patch(f"{CMS}/a", {"data": {"k": "2"}})["metadata"]["resourceVersion"]
    assert int(v2) > int(v1) and v3 == v2
    assert len(api.api.objects[kmock.resource("v1/configmaps"), "ml", "a"].history) == 2  # the no-op added none


def test_json_patch_test_failure_is_a_422_and_changes_nothing(api):
    obj = api.create(CMS, {"metadata": {"name": "a", "finalizers": ["x/y"]}})
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"},
             {"op": "remove", "path": "/metadata/finalizers"}]
    with pytest.raises(ApiFailure) as failed:
        api.patch(f"{CMS}/a", stale, JSON_PATCH)
    assert failed.value.status == 422
    assert api.get(f"{CMS}/a") == obj


def test_apply_creates_then_replaces_what_it_owns(api):
    body = {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d", "labels": {"a": "1"}}, "spec": {"replicas": 2, "paused": True}}
    created = api.patch(f"{DEPLOYMENTS}/d", body, APPLY)
    assert created["metadata"]["generation"] == 1
    api.patch(f"{DEPLOYMENTS}/d/status", {"status": {"readyReplicas": 2}})
    applied = api.patch(f"{DEPLOYMENTS}/d", {**body, "spec": {"replicas": 3}}, APPLY)
    assert applied["spec"] == {"replicas": 3}  # paused: no longer applied, so gone
    assert applied["status"] == {"readyReplicas": 2}  # status is not the applier's
    assert applied["metadata"]["uid"] == created["metadata"]["uid"] and applied["metadata"]["generation"] == 2


def test_status_goes_through_its_subresource_only(api):
    api.create(DEPLOYMENTS, {"metadata": {"name": "d"}, "spec": {"replicas": 1}, "status": {"readyReplicas": 9}})
    assert "status" not in api.get(f"{DEPLOYMENTS}/d")  # dropped on create
    api.patch(f"{DEPLOYMENTS}/d", {"status": {"readyReplicas": 1}})
    assert "status" not in api.get(f"{DEPLOYMENTS}/d")  # ignored on the main resource
    api.patch(f"{DEPLOYMENTS}/d/status", {"spec": {"replicas": 5}, "status": {"readyReplicas": 1}})
    obj = api.get(f"{DEPLOYMENTS}/d")
    assert obj["spec"]["replicas"] == 1 and obj["status"] == {"readyReplicas": 1}
    assert obj["metadata"]["generation"] == 1  # status writes do not bump it


def test_delete_waits_for_the_finalizers(api):
    api.create(CMS, {"metadata": {"name": "a", "finalizers": ["x/y"]}})
    marked = api.delete(f"{CMS}/a")
    assert marked["metadata"]["deletionTimestamp"]
    assert api.get(f"{CMS}/a")["metadata"]["deletionTimestamp"]
    api.patch(f"{CMS}/a", {"metadata": {"finalizers": None}})
    assert api.get(f"{CMS}/a") is None
    api.create(CMS, {"metadata": {"name": "b"}})
    api.delete(f"{CMS}/b")
    assert api.get(f"{CMS}/b") is None


def test_lists_honour_label_selectors(api):
    api.create(CMS, {"metadata": {"name": "a", "labels": {"app": "x", "tier": "1"}}})
    api.create(CMS, {"metadata": {"name": "b", "labels": {"app": "y"}}})
    api.create("/api/v1/namespaces/other/configmaps", {"metadata": {"name": "c", "labels": {"app": "x"}}})
    names = lambda items: sorted(i["metadata"]["name"] for i in items)  # noqa: E731
    assert names(api.list(CMS, "app=x")) == ["a"]
    assert names(api.list(CMS, "app=x,tier=2")) == []
    assert names(api.list(CMS)) == ["a", "b"]
    assert names(api.list("/api/v1/configmaps", "app=x")) == ["a", "c"]
    assert selector_matches("app!=y,!gone,tier", {"app": "x", "tier": "1"})


def test_no_put_and_unknown_resources(api):
    api.create(CMS, {"metadata": {"name": "a"}})
    with pytest.raises(ApiFailure) as put:
        api.call("PUT", f"{CMS}/a", {"metadata": {"name": "a"}})
    assert put.value.status == 405
    with pytest.raises(ApiFailure) as unknown:
        api.list("/apis/example.com/v1/namespaces/ml/widgets")
    assert unknown.value.status == 404


def test_a_fail_hook_answers_instead_of_writing_then_is_spent(api):
    failing = api.fail(lambda r: r.name == "a", status=500)
    with pytest.raises(ApiFailure) as failed:
        api.patch(f"{CMS}/a", {"data": {}}, APPLY)
    assert failed.value.status == 500 and failing.hit.is_set() and api.get(f"{CMS}/a") is None
    api.patch(f"{CMS}/a", {"metadata": {"name": "a"}, "data": {}}, APPLY)  # spent: this one goes through
    assert api.get(f"{CMS}/a") is not None
