"""The Secret NAME-internal: the deployment's internal secret (tessera/internal_secret.py),
created by the operator when spec.internalSecretRef does not name the user's own.

Created once and never written again: get, then create if absent. Server-side apply would put a
fresh random value on every pass and so rotate it under running pods. A 409 on create means
someone (another pass, a user) made it in between, which is as good. The owner reference lets
it go with the InferenceService; `immutable` keeps a hand edit from changing it under pods that
read it at start (delete it and restart the pods to rotate).
"""

from __future__ import annotations

import base64

from tessera.internal_secret import SECRET_KEY, InternalSecret
from tessera_operator import names, pod_parts
from tessera_operator.kube import ClusterApi
from tessera_operator.names import Owner


def secret_object(owner: Owner, secret: InternalSecret) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": pod_parts.object_meta(owner, names.internal_secret_name(owner), names.labels(owner, "internal")),
        "type": "Opaque",
        "immutable": True,
        "data": {SECRET_KEY: base64.b64encode(secret.value).decode()},
    }


def ensure(api: ClusterApi, owner: Owner, spec: dict) -> bool:
    """Make NAME-internal exist (unless the spec names its own Secret); True when it was created now."""
    if spec.get("internalSecretRef"):
        return False
    if api.secret_exists(owner.namespace, names.internal_secret_name(owner)):
        return False
    return api.create(secret_object(owner, InternalSecret.generate()))
