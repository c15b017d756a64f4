"""The real operator process when things go wrong: an invalid resource, and the process killed
(SIGKILL) mid-reconcile, then again while kopf waits to retry a failed write, and restarted."""

from __future__ import annotations

import datetime
import json
import time

from tessera.internal_secret import SECRET_KEY

from .conftest import TICK_S, collection, example, wait_for
from .emulator import secret_value
from .test_lifecycle import FINALIZER, expected_objects

PROGRESS = "tessera.dev/on_change"  # kopf's progress storage of the change handler (annotations, our prefix)


def test_an_invalid_resource_gets_a_condition_and_one_event_and_nothing_else(cluster, operator):
    """The API server would refuse this one (the CRD's CEL rule minReplicas <= maxReplicas); without
    admission (the emulator has none) it reaches the operator, which must say so once, create
    nothing, keep running and serve the other resources."""
    bad = example("mixed")
    bad["metadata"]["name"] = "bad"
    bad["spec"]["pools"]["mixed"].update(minReplicas=5, maxReplicas=2)
    cluster.apply_isvc(bad)

    ready = wait_for(lambda: cluster.condition("bad"), "a condition on the invalid resource", logs=operator.log)
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "spec.pools.mixed" in ready["message"] and "minReplicas must not exceed maxReplicas" in ready["message"]
    (event,) = wait_for(lambda: cluster.events("bad"), "the event")
    assert (event["type"], event["reason"], event["message"]) == ("Warning", "InvalidSpec", ready["message"])

    # A valid neighbour is served meanwhile: the operator is not stuck on the bad one.
    good = example("mixed")
    cluster.apply_isvc(good)
    wait_for(lambda: set(cluster.owned("llama-mixed")) == expected_objects(good), "the valid neighbour's objects")

    # Ticks go by: no retry storm, no second event, no write to the resource, nothing created.
    version = cluster.isvc("bad")["metadata"]["resourceVersion"]
    time.sleep(3 * TICK_S)
    assert [e["reason"] for e in cluster.events("bad")] == ["InvalidSpec"]
    assert cluster.isvc("bad")["metadata"]["resourceVersion"] == version
    assert cluster.owned("bad") == {}
    assert cluster.get(collection("Secret") + "/bad-internal") is None
    assert operator.alive and "Traceback" not in operator.log()

    # Fixed, it is reconciled like any other.
    cluster.edit_isvc("bad", {"spec": {"pools": {"mixed": {"maxReplicas": 6}}}})
    wait_for(lambda: set(cluster.owned("bad")) == expected_objects(bad), "the fixed resource's objects",
             logs=operator.log)
    wait_for(lambda: (cluster.condition("bad") or {}).get("reason") == "ComponentsNotReady", "its real condition")
    assert cluster.deployment("bad-engine")["spec"]["replicas"] == 5


def _is(resource: str, name: str):
    """A matcher for the emulator's write hooks: server-side apply of one object."""
    return lambda request: (request.method == "PATCH" and request.resource.plural == resource
                            and request.name == name and request.subresource is None)


def test_killed_mid_reconcile_and_restarted_it_converges_without_duplicates(cluster, start_operator):
    body = example("mixed")
    name = body["metadata"]["name"]
    gateway = f"{name}-gateway"

    # 1. Killed while a write is in flight: the gateway Deployment's apply is held, then the process dies.
    held = cluster.hold(_is("deployments", gateway))
    held.times = 1000  # every handler's attempt (the change handler's and the timer's) waits
    first = start_operator()
    cluster.apply_isvc(body)
    assert held.hit.wait(20), first.log()
    first.kill()
    cluster.release(held, drop=True)  # the write never happened
    partial = cluster.owned(name)
    assert ("Deployment", gateway) not in partial and ("Secret", f"{name}-internal") in partial
    secret = secret_value(partial[("Secret", f"{name}-internal")], SECRET_KEY)
    isvc = cluster.isvc(name)
    assert isvc["metadata"]["finalizers"] == [FINALIZER] and not isvc.get("status")

    # 2. Restarted, the write fails (the API server answers 500): kopf records a retry in the
    #    resource's annotations (its progress storage), and the process is killed while it waits.
    failing = cluster.fail(_is("deployments", gateway), status=500, times=1000)
    second = start_operator()
    progress = wait_for(lambda: (cluster.isvc(name)["metadata"].get("annotations") or {}).get(PROGRESS),
                        "kopf's progress record of the failed attempt", logs=second.log)
    record = json.loads(progress)
    assert record["retries"] == 1 and record["delayed"] and not record["success"]
    failed = [e for e in cluster.events(name) if e["reason"] == "ApplyFailed"]
    assert failed and failed[0]["type"] == "Warning" and "HTTP 500" in failed[0]["message"]
    second.kill()
    failing.times = 0  # the API server is well again
    delayed = datetime.datetime.fromisoformat(record["delayed"])

    # 3. Restarted again: kopf resumes the handler from the stored record (it waits out the delay,
    #    then retries), and everything converges to one set of objects.
    third = start_operator()
    owned = wait_for(lambda: (o := cluster.owned(name)) and set(o) == expected_objects(body) and o,
                     "the objects", timeout=30, logs=third.log)
    applied = wait_for(lambda: [e for e in cluster.events(name) if e["reason"] == "Applied"],
                       "the change handler to complete", timeout=30, logs=third.log)
    assert len(applied) == 1 and applied[0]["message"].endswith("(create)")
    assert datetime.datetime.fromisoformat(applied[0]["eventTime"]) >= delayed  # not before the stored delay
    wait_for(lambda: PROGRESS not in (cluster.isvc(name)["metadata"].get("annotations") or {}),
             "the progress record purged once done", logs=third.log)

    # No duplicates, nothing recreated, the internal secret never rotated.
    for key, obj in partial.items():
        assert owned[key]["metadata"]["uid"] == obj["metadata"]["uid"], key
    assert secret_value(owned[("Secret", f"{name}-internal")], SECRET_KEY) == secret
    assert cluster.reasons(name).count("Created") == 1
    isvc = cluster.isvc(name)
    assert isvc["metadata"]["finalizers"] == [FINALIZER]
    assert "tessera.dev/last-handled-configuration" in isvc["metadata"]["annotations"]
    wait_for(lambda: (cluster.condition(name) or {}).get("reason") == "ComponentsNotReady", "the Ready condition")
    all_deployments = cluster.list(collection("Deployment"))
    assert sorted(d["metadata"]["name"] for d in all_deployments) == [f"{name}-engine", gateway]
    assert third.alive
