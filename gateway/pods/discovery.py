"""Where the engine pods are: a static list, the EndpointSlices of the
pools' Services in a cluster (kept current by a watch), or a file of
addresses read again whenever it changes."""

from __future__ import annotations

import asyncio
import logging
import threading

import os
from pathlib import Path

import yaml

from gateway.config import FileDiscovery, KubernetesDiscovery, PodsConfig
from gateway.pods.pool import PodPool
from tessera.roles import POD_ROLES

logger = logging.getLogger(__name__)


def static_members(config: PodsConfig) -> dict[str, list[str]]:
    members: dict[str, list[str]] = {}
    for pod in config.static:
        members.setdefault(pod.role, []).append(pod.address)
    return members


def addresses_from_slices(slices: list[dict], port_name: str) -> list[str]:
    """host:port of every ready endpoint in the EndpointSlices (plain dicts, as
    the API returns them), on the port named `port_name`; sorted, unique."""
    found = set()
    for s in slices:
        ports = [p for p in (s.get("ports") or []) if p.get("name") == port_name]
        if not ports or ports[0].get("port") is None:
            continue
        port = ports[0]["port"]
        for endpoint in s.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            # Absent `ready` means ready (the API's rule); terminating pods drain.
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                found.add(f"{host}:{port}")
    return sorted(found)


class EndpointSliceWatcher:
    """Watches each pool Service's EndpointSlices on a thread (the kubernetes
    client is synchronous) and hands membership to the pool's event loop."""

    def __init__(self, config: KubernetesDiscovery, pool: PodPool, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.pool = pool
        self.loop = loop
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(role, service), daemon=True,
                                          name=f"endpoints-{role}")
                         for role, service in config.services.items()]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self, role: str, service: str) -> None:
        from kubernetes import client, config as k8s_config, watch

        try:
            k8s_config.load_incluster_config()
        except k8s_config.ConfigException:
            k8s_config.load_kube_config()
        api = client.DiscoveryV1Api(client.ApiClient())
        selector = f"kubernetes.io/service-name={service}"
        while not self._stop.is_set():
            try:
                listed = api.list_namespaced_endpoint_slice(self.config.namespace, label_selector=selector)
                slices = {s.metadata.name: api.api_client.sanitize_for_serialization(s) for s in listed.items}
                self._publish(role, slices)
                stream = watch.Watch().stream(api.list_namespaced_endpoint_slice, self.config.namespace,
                                              label_selector=selector,
                                              resource_version=listed.metadata.resource_version,
                                              timeout_seconds=int(self.config.resync_s))
                for event in stream:
                    obj = api.api_client.sanitize_for_serialization(event["object"])
                    name = obj["metadata"]["name"]
                    if event["type"] == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = obj
                    self._publish(role, slices)
                    if self._stop.is_set():
                        return
            except Exception as e:  # API hiccups: re-list after a pause
                logger.warning("discovery: %s/%s: %s", self.config.namespace, service, e)
                self._stop.wait(2.0)

    def _publish(self, role: str, slices: dict[str, dict]) -> None:
        addresses = addresses_from_slices(list(slices.values()), self.config.port_name)
        self.loop.call_soon_threadsafe(self.pool.set_members, role, addresses)


def members_from_file(text: str) -> dict[str, list[str]]:
    """The pods a discovery file lists, by role: a YAML mapping of roles to
    lists of host:port. ValueError naming what is wrong."""
    data = yaml.safe_load(text) if text.strip() else {}
    if not isinstance(data, dict):
        raise ValueError("expected a mapping of roles to lists of host:port")
    members: dict[str, list[str]] = {}
    for role, addresses in data.items():
        if role not in POD_ROLES:
            raise ValueError(f"role {role!r} is not one of {POD_ROLES}")
        if not isinstance(addresses, list) or not all(isinstance(a, str) and ":" in a for a in addresses):
            raise ValueError(f"{role}: expected a list of host:port")
        members[role] = sorted(set(addresses))
    return members


class FileWatcher:
    """Polls the discovery file on the pool's event loop and makes each
    role's pods exactly what it lists. A file that is missing or malformed
    keeps the pods as they are (logged), so a half-written file never
    empties the pool: write it elsewhere and rename it into place."""

    def __init__(self, config: FileDiscovery, pool: PodPool) -> None:
        self.config = config
        self.pool = pool
        self._seen: tuple[int, int] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.poll()  # the first membership before the first request
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            self.poll()

    def poll(self) -> None:
        path = Path(self.config.path)
        try:
            stat = os.stat(path)
        except OSError as e:
            if self._seen != (-1, -1):
                logger.error("pods.file: cannot read %s (%s); keeping the pods as they are", path, e.strerror)
                self._seen = (-1, -1)
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._seen:
            return
        self._seen = stamp
        try:
            members = members_from_file(path.read_text())
        except (OSError, ValueError, yaml.YAMLError) as e:
            logger.error("pods.file: %s: %s; keeping the pods as they are", path, e)
            return
        for role in POD_ROLES:
            self.pool.set_members(role, members.get(role, []))
