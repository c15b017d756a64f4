"""A Kubernetes API emulator for the operator's end-to-end tests: kmock's KubernetesEmulator, made
close enough to an API server for kopf and the operator's client, served on a free loopback port
from a thread of the test process.

What it adds to kmock 0.8 (`EmulatedApiServer`):

- every write stamps metadata as the API server does: `uid`, `creationTimestamp`, `generation`
  (1, then +1 when anything outside metadata and status changes) on create; a fresh
  `resourceVersion` on every write (kopf's finalizer JSON patch tests it, and kopf waits for the
  version its own patches returned; an empty one breaks both, as does `kopf.adopt`'s uid);
- create answers 201, names an object from `metadata.generateName` (kopf's events), and drops
  `status` of a resource with a status subresource;
- PATCH: merge patch, JSON patch (a failed `test` op answers 422 as the API server does, which
  kopf reads as a conflict to retry), and server-side apply (`application/apply-patch+yaml`):
  it creates a missing object, and on an existing one the applied object replaces every field
  but metadata and status (one field manager with force: the operator's own case), its labels
  and annotations merge into the old ones. A patch that changes nothing is a no-op: no new
  resourceVersion, no watch event. The status subresource changes only status; the main
  resource of one with a status subresource leaves status alone;
- DELETE of an object with finalizers sets `deletionTimestamp` (with a new resourceVersion);
  removing the last finalizer then deletes it;
- list honours equality `labelSelector`s (`a=b,c=d`), as the operator's pruning and pod
  listing need: kmock lists every object of the resource;
- a watch takes its place in the event stream before it replays the existing objects, so no
  write slips between the replay and the live events;
- reads of one object and lists are served directly (kmock's fallback reactions look for each
  request among all requests served so far, a cost that grows as an operator polls);
- test hooks on writes (`fail`, `hold`): answer an error instead, or hold a request until the
  test lets it through or drops it (to kill an operator mid-write).

Known gaps, none of them emulated (docs/operator.md, "Tested against an API emulator"):

- no controllers: nothing creates ReplicaSets or Pods, nothing writes a Deployment's status
  (tests patch `/status` themselves);
- no garbage collection: owner references are stored, never followed; children outlive a
  deleted owner;
- no PUT (update): answered 405;
- no admission: neither the CRD's OpenAPI schema nor its CEL rules (x-kubernetes-validations)
  are checked, no defaulting, no RBAC (every request is allowed);
- server-side apply without managed fields: no per-field ownership, no conflicts between
  managers, fields another writer set inside a replaced field are lost; strategic merge
  patches merge like merge patches (lists replaced whole, no patch keys);
- a watch replays every object as ADDED whatever resourceVersion it asks from, and honours
  no label or field selector; no bookmarks, no 410 Gone;
- kubectl cannot talk to it (no OpenAPI document, no table output);
- namespaces are listed in discovery but cannot be read or created: kmock 0.8 parses
  `/api/v1/namespaces[/NAME]` as a namespace prefix without a resource. The operator needs none
  (it names its namespaces; kopf's namespace scanning is off), and objects need no Namespace
  object to live in a namespace here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import json
import re
import secrets
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml

# What the operator and kopf talk to (operator/tessera_operator/kube.py's MANAGED_KINDS, CREATED_KINDS
# and pods; kopf's events, namespaces and, with scanning on, CRDs), and the CRD: name -> discovery info.
RESOURCES: dict[str, dict[str, Any]] = {
    "tessera.dev/v1alpha1/inferenceservices": {"kind": "InferenceService", "singular": "inferenceservice",
                                               "shortnames": ["tisvc"], "subresources": ["status"]},
    "v1/namespaces": {"kind": "Namespace", "namespaced": False, "subresources": ["status"]},
    "v1/events": {"kind": "Event"},
    "v1/configmaps": {"kind": "ConfigMap"},
    "v1/secrets": {"kind": "Secret"},
    "v1/services": {"kind": "Service", "subresources": ["status"]},
    "v1/serviceaccounts": {"kind": "ServiceAccount"},
    "v1/pods": {"kind": "Pod", "subresources": ["status"]},
    "apps/v1/deployments": {"kind": "Deployment", "subresources": ["status"]},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy"},
    # Served by the LeaderWorkerSet controller's CRD on a real cluster (pipeline-parallel pools).
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": {"kind": "LeaderWorkerSet", "subresources": ["status"]},
    "rbac.authorization.k8s.io/v1/roles": {"kind": "Role"},
    "rbac.authorization.k8s.io/v1/rolebindings": {"kind": "RoleBinding"},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {"kind": "CustomResourceDefinition",
                                                          "namespaced": False, "subresources": ["status"]},
}
VERBS = ["create", "delete", "get", "list", "patch", "watch"]
APPLY = "application/apply-patch+yaml"
JSON_PATCH = "application/json-patch+json"
# Fields the API server owns: a patch or an apply cannot change them (DELETE sets deletionTimestamp).
SERVER_FIELDS = ("uid", "creationTimestamp", "resourceVersion", "generation", "name", "namespace",
                 "deletionTimestamp")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Equality-based label selectors (`a=b`, `a==b`, `a!=b`, `a`, `!a`), comma-separated."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key.strip()) != value.strip()
        elif "=" in term:
            key, value = re.split("==?", term, maxsplit=1)
            ok = labels.get(key.strip()) == value.strip()
        elif term.startswith("!"):
            ok = term[1:].strip() not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


@dataclass
class Hook:
    """A test's hold on writes that match: fail them, or hold them until released."""

    matches: Callable[[kmock.Request], bool]
    status: int = 0             # fail: answer this HTTP status instead of writing
    times: int = 1              # how many matching requests it takes (then it is spent)
    hold: bool = False
    hit: threading.Event = field(default_factory=threading.Event)  # a matching request arrived
    _release: asyncio.Event | None = None
    _drop: bool = False


@attrs.define(kw_only=True)
class EmulatedApiServer(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with the API server's metadata and write semantics the operator
    needs; see the module's docstring for what it adds and what it leaves out."""

    _version: int = attrs.field(default=0, init=False)  # the last resourceVersion given out
    _writes: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    hooks: list[Hook] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for name, info in RESOURCES.items():
            self.resources[name] = kmock.ResourceInfo(
                kind=info["kind"], singular=info.get("singular", info["kind"].lower()),
                namespaced=info.get("namespaced", True), verbs=VERBS,
                shortnames=info.get("shortnames", []), subresources=info.get("subresources", []))

    def _has_status(self, resource: kmock.resource) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.resource.plural is None:  # discovery, /version
            return await super()._handle(request)
        if request.method == kmock.method.PUT:
            raise kmock.KubernetesError(405, "MethodNotAllowed", "the emulator has no PUT (update): PATCH instead")
        if request.action == kmock.action.LIST:
            return await self._list(request)
        if request.action == kmock.action.FETCH and request.subresource is None:
            return await self._fetch(request)
        if request.action not in (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE):
            return await super()._handle(request)
        await self._run_hooks(request)
        async with self._writes:  # one write at a time: each is computed from the state it changes
            try:
                return await self._write(request)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
                raise kmock.KubernetesError(422, "Invalid", f"the JSON patch does not apply: {e}") from None

    async def _write(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        current = self.objects[key] if key in self.objects else None
        old = None if current is None or current.deleted else copy.deepcopy(current.raw)
        if request.action == kmock.action.CREATE:
            return await self._create(request, request.data or {})
        if old is None:
            content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
            if request.action == kmock.action.UPDATE and content_type == APPLY:
                body = _apply_body(request)
                body.setdefault("metadata", {}).update(name=request.name, namespace=request.namespace)
                return await self._create(request, body)
            raise kmock.KubernetesObjectNotFoundError()
        if request.action == kmock.action.DELETE:
            meta = old["metadata"]
            if not meta.get("finalizers"):
                await self._store(request.resource, key, None)
                return aiohttp.web.json_response(old)
            new = copy.deepcopy(old)
            new["metadata"].setdefault("deletionTimestamp", _now())
        else:
            new = self._patched(request, old)
        if new == old:  # the API server's no-op: no new version, no event
            return aiohttp.web.json_response(old)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            await self._store(request.resource, key, None)  # the last finalizer gone: deleted now
            return aiohttp.web.json_response(old)
        outside = lambda obj: {k: v for k, v in obj.items() if k not in ("metadata", "status")}  # noqa: E731
        generation = old["metadata"].get("generation", 1) + (outside(new) != outside(old))
        new["metadata"].update(resourceVersion=self._next_version(), generation=generation)
        await self._store(request.resource, key, new)
        return aiohttp.web.json_response(new)

    async def _store(self, resource: kmock.resource, key: tuple, new: dict | None) -> None:
        """Write one object's new version (None: delete it) and tell the watches, as kmock does."""
        async with self._lock:
            current = self.objects[key] if key in self.objects else None
            if new is None:
                assert current is not None
                last = copy.deepcopy(current.raw)
                current.delete()
                event = {"type": "DELETED", "object": last}
            elif current is None or current.deleted:
                if current is None:
                    self.objects[key] = new
                else:
                    current.create(new)
                event = {"type": "ADDED", "object": copy.deepcopy(new)}
            else:
                current.history.append(new)  # a new version (kmock keeps the history)
                event = {"type": "MODIFIED", "object": copy.deepcopy(new)}
            await self._buses[resource].put(event)

    def _patched(self, request: kmock.Request, old: dict) -> dict:
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        if content_type == APPLY:
            applied = _apply_body(request)
            new = {k: v for k, v in applied.items() if k not in ("metadata", "status")}
            meta = copy.deepcopy(old["metadata"])
            for merged in ("labels", "annotations"):
                if merged in applied.get("metadata", {}):
                    meta[merged] = {**meta.get(merged, {}), **applied["metadata"][merged]}
            for replaced in ("ownerReferences", "finalizers"):
                if replaced in applied.get("metadata", {}):
                    meta[replaced] = applied["metadata"][replaced]
            new = {**new, "metadata": meta, **({"status": old["status"]} if "status" in old else {})}
        else:  # kmock's patching: a JSON patch (a list), or a merge patch (strategic ones merge the same)
            patched = kmock.Object(copy.deepcopy(old))
            patched.patch(request.data or {})
            new = copy.deepcopy(patched.raw)
        if request.subresource == "status":  # the status subresource changes status alone
            new = {**{k: v for k, v in old.items() if k != "status"},
                   **({"status": new["status"]} if "status" in new else {})}
        elif self._has_status(request.resource):
            new.pop("status", None)
            if "status" in old:
                new["status"] = old["status"]
        meta = new.setdefault("metadata", {})
        for name in SERVER_FIELDS:  # as the API server keeps them, whatever the patch said
            if name in old["metadata"]:
                meta[name] = old["metadata"][name]
            else:
                meta.pop(name, None)
        if not meta.get("finalizers"):
            meta.pop("finalizers", None)  # an empty list is no list, as the API server stores it
        return new

    async def _create(self, request: kmock.Request, body: dict) -> aiohttp.web.StreamResponse:
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise kmock.KubernetesError(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if request.resource not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        namespaced = self.resources[request.resource].namespaced
        if namespaced:
            namespace = request.namespace or meta.get("namespace") or "default"
            if meta.get("namespace", namespace) != namespace:
                raise kmock.KubernetesError(400, "BadRequest", "metadata.namespace does not match the request")
            meta["namespace"] = namespace
        key = (request.resource, meta.get("namespace"), meta["name"])
        if key in self.objects and not self.objects[key].deleted:
            raise kmock.KubernetesError(409, "AlreadyExists", f"{request.resource.plural} {meta['name']!r} "
                                        "already exists")
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=self._next_version(),
                    generation=1)
        meta.pop("deletionTimestamp", None)
        if self._has_status(request.resource):
            body.pop("status", None)
        await self._store(request.resource, key, body)
        return aiohttp.web.json_response(body, status=201)

    async def _fetch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            return aiohttp.web.json_response(copy.deepcopy(self.objects[key].raw))

    async def _list(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        selector = request.params.get("labelSelector")
        async with self._lock:
            items = [copy.deepcopy(obj.raw) for (resource, namespace, _), obj in self.objects.items()
                     if resource == request.resource and not obj.deleted
                     and (request.namespace is None or namespace == request.namespace)
                     and selector_matches(selector, obj.raw.get("metadata", {}).get("labels") or {})]
            version = str(self._version)
        kind = self.resources[request.resource].kind
        group_version = "/".join(filter(None, (request.resource.group, request.resource.version)))
        return aiohttp.web.json_response({"apiVersion": group_version, "kind": f"{kind}List",
                                          "metadata": {"resourceVersion": version}, "items": items})

    async def _serve_watch(self, request: kmock.Request):  # type: ignore[override]
        yield b""  # the headers go out at once, even before any event
        bus = self._buses[request.resource]
        mark = await bus.mark()  # first in the stream, then the replay: nothing falls between
        try:
            async with self._lock:
                replay = [{"type": "ADDED", "object": copy.deepcopy(obj.raw)}
                          for (resource, namespace, _), obj in self.objects.items()
                          if resource == request.resource and not obj.deleted
                          and (request.namespace is None or namespace == request.namespace)]
            for event in replay:
                yield event
            async for event in bus.stream(since=mark):
                meta = event.get("object", {}).get("metadata", {})
                if request.namespace is None or meta.get("namespace") == request.namespace:
                    if request.name is None or meta.get("name") == request.name:
                        yield event
        finally:
            await bus.unmark(mark)

    async def _run_hooks(self, request: kmock.Request) -> None:
        for hook in list(self.hooks):
            if hook.times <= 0 or not hook.matches(request):
                continue
            hook.times -= 1
            hook.hit.set()
            if hook.hold:
                assert hook._release is not None
                await hook._release.wait()
                if hook._drop:
                    raise kmock.KubernetesError(503, "ServiceUnavailable", "dropped by the test")
            elif hook.status:
                raise kmock.KubernetesError(hook.status, "InternalError", "failed by the test")


def _apply_body(request: kmock.Request) -> dict:
    """The applied object: JSON (what the official client sends) or YAML (kubectl's)."""
    if isinstance(request.data, dict):
        return copy.deepcopy(request.data)
    return yaml.safe_load(request.text) or {}


class ApiFailure(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")


class Emulator:
    """An EmulatedApiServer on 127.0.0.1 and a free port, served from a thread of its own (its own
    event loop), with a small blocking client for tests (plain HTTP: no code of the operator's)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kube-api-emulator", daemon=True)
        self.api: EmulatedApiServer
        self.url = ""
        self.last_status = 0  # the HTTP status of the client's last answer
        self._stack = contextlib.AsyncExitStack()

    def __enter__(self) -> Emulator:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.api.hooks:  # nothing stays held
            self.release(hook, drop=True)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stack.aclose(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    async def _start(self) -> None:
        self.api = await self._stack.enter_async_context(EmulatedApiServer())
        server = await self._stack.enter_async_context(kmock.Server(self.api, host="127.0.0.1"))
        self.url = str(server.url).rstrip("/")

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulated"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                          "namespace": namespace}}],
        }))
        return path

    # -- test hooks -------------------------------------------------------------------------------

    def _add(self, hook: Hook) -> Hook:
        if hook.hold:
            hook._release = asyncio.run_coroutine_threadsafe(_new_event(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.api.hooks.append, hook)
        return hook

    def fail(self, matches: Callable[[kmock.Request], bool], status: int = 500, times: int = 1) -> Hook:
        """Answer the next `times` matching writes with `status` (nothing written)."""
        return self._add(Hook(matches, status=status, times=times))

    def hold(self, matches: Callable[[kmock.Request], bool]) -> Hook:
        """Hold the next matching write until `release`; `hook.hit` is set when it arrives."""
        return self._add(Hook(matches, hold=True))

    def release(self, hook: Hook, drop: bool = False) -> None:
        """Let the held writes through, or drop them (answered 503, nothing written); the hook is spent."""
        hook._drop, hook.times = drop, 0
        if hook._release is not None:
            self.loop.call_soon_threadsafe(hook._release.set)

    def requests(self) -> list[kmock.Request]:
        return list(self.api)  # kmock: the root view iterates over every request served

    # -- a blocking client ------------------------------------------------------------------------

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
             query: dict[str, str] | None = None) -> Any:
        url = self.url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Content-Type": content_type, "Accept": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
        try:
            with opener.open(request, timeout=10) as response:
                self.last_status = response.status
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            raise ApiFailure(e.code, method, path, e.read().decode(errors="replace")) from None

    def get(self, path: str) -> dict | None:
        try:
            return self.call("GET", path)
        except ApiFailure as e:
            if e.status == 404:
                return None
            raise

    def list(self, path: str, selector: str | None = None) -> list[dict]:
        return self.call("GET", path, query={"labelSelector": selector} if selector else None)["items"]

    def create(self, path: str, body: dict) -> dict:
        return self.call("POST", path, body)

    def patch(self, path: str, body: Any, content_type: str = "application/merge-patch+json") -> dict:
        return self.call("PATCH", path, body, content_type)

    def delete(self, path: str) -> dict:
        return self.call("DELETE", path)


async def _new_event() -> asyncio.Event:
    return asyncio.Event()  # made on the emulator's loop


def secret_value(secret: dict, key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()
