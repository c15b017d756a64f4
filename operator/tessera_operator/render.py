"""`tessera render`: the objects the operator would apply for an InferenceService, off-cluster.

The objects come from reconcile.desired_objects, the function the kopf handlers apply, so
a rendered stream and a reconcile pass agree object for object. Two things differ, and the
stream's header says so:

- ownerReferences need the InferenceService's uid, which only the API server assigns: they
  are kept when the resource carries metadata.uid (`kubectl get -o yaml` output) and
  dropped otherwise (a reference with an empty uid is rejected by the API server).
- the internal Secret NAME-internal is never rendered: the operator creates it once with a
  fresh random value (internal_secret.py), and a credential has no place in a manifest
  stream or a GitOps repository.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import yaml

from tessera.internal_secret import SECRET_KEY
from tessera_operator import names
from tessera_operator.names import Owner
from tessera_operator.reconcile import desired_objects, validated


def render_objects(body: dict, namespace: str | None = None, operator_namespace: str | None = None) -> list[dict]:
    """The objects a reconcile pass applies for `body`, in apply order.

    `namespace` replaces metadata.namespace (absent both: "default", as on the cluster);
    `operator_namespace` is the operator's --operator-namespace (NetworkPolicies admit it).
    Raises InvalidInferenceService as the operator would.
    """
    body = in_namespace(body, namespace)
    objects = desired_objects(body, operator_namespace=operator_namespace)
    if not body["metadata"].get("uid"):
        for obj in objects:
            obj["metadata"].pop("ownerReferences", None)
    return objects


def in_namespace(body: dict, namespace: str | None) -> dict:
    """A copy of the resource in `namespace`, or in its own (absent: "default"). Moved to another
    namespace it loses its uid: that uid names an object elsewhere, and an owner reference across
    namespaces would have the garbage collector delete the objects."""
    body = copy.deepcopy(body)
    meta = body.setdefault("metadata", {})
    own = meta.get("namespace") or "default"
    if namespace and namespace != own:
        meta.pop("uid", None)
    meta["namespace"] = namespace or own
    return body


def secret_refs(objects: list[dict]) -> list[str]:
    """Names of the Secrets the rendered pods read (volumes and environment): they must exist."""
    return sorted({name for obj in objects for name in _pod_secret_names(obj)})


def _pod_templates(obj: dict) -> list[dict]:
    """The pod templates of a workload: a Deployment's, a LeaderWorkerSet's leader and worker."""
    spec = obj.get("spec", {})
    group = spec.get("leaderWorkerTemplate", {})
    return [t for t in (spec.get("template"), group.get("leaderTemplate"), group.get("workerTemplate")) if t]


def _pod_secret_names(obj: dict) -> Iterator[str]:
    for template in _pod_templates(obj):
        yield from _template_secret_names(template.get("spec", {}))


def _template_secret_names(pod: dict) -> Iterator[str]:
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            yield volume["secret"]["secretName"]
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                yield source["secret"]["name"]
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                yield ref["name"]


def header(body: dict, objects: list[dict], source: str) -> str:
    """The comment that opens a rendered stream: what it holds and what it leaves out
    (`body` already in its namespace)."""
    isvc = validated(body)
    owner = Owner.of(isvc)
    lines = [f"Rendered by `tessera render` from {source}: InferenceService {owner.name} "
             f"in namespace {owner.namespace}, {len(objects)} objects."]
    if not isvc["spec"].get("internalSecretRef"):
        secret = names.internal_secret_name(owner)
        lines += [f"Not included: the Secret {secret} (the internal secret). The operator creates it",
                  "with a random value; without the operator, create it once yourself:",
                  f"  kubectl -n {owner.namespace} create secret generic {secret} \\",
                  f"    --from-literal={SECRET_KEY}=\"$(tessera internal-secret)\""]
    if not body["metadata"].get("uid"):
        lines.append("No ownerReferences: the InferenceService's uid is assigned by the API server.")
    refs = secret_refs(objects)
    if refs:
        lines.append(f"Secrets the pods read (must exist in {owner.namespace}): {', '.join(refs)}.")
    return "".join(f"# {line}\n" for line in lines)


class _ManifestDumper(yaml.SafeDumper):
    """Plain YAML for kubectl and people: no anchors, multi-line strings (config files) as blocks."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _str)


def manifest_yaml(objects: list[dict]) -> str:
    """A multi-document YAML stream, one object per document."""
    return yaml.dump_all(objects, Dumper=_ManifestDumper, sort_keys=False, explicit_start=True, width=120)


def render_stream(body: dict, source: str, namespace: str | None = None,
                  operator_namespace: str | None = None) -> str:
    """`tessera render`'s output for one InferenceService: the header, then its objects."""
    body = in_namespace(body, namespace)
    objects = render_objects(body, operator_namespace=operator_namespace)
    return header(body, objects, source) + manifest_yaml(objects)
