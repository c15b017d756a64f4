"""The LoRA adapters a pod serves, by the names clients call them.

Adapters come from ``--lora-modules NAME=PATH`` at start-up (the operator's
flags, trusted) and from the LoadLoRAAdapter RPC at run time (a gateway's
admin endpoint), whose path must lie inside one of the pod's ``--lora-root``
folders: an internal caller may name adapters, not read the pod's files.
Each is checked against the model once, when registered (Processor.process_lora),
so a Generate on it does no file I/O; a name registered again gets a new id,
never one an engine already cached under other weights.

Called from the gRPC frontend's thread; registrations may run on worker
threads (the check reads files), so every change takes the lock.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from engine_pod.lora_request import AdapterSpec, LoRARequest
from engine_pod.processor import Processor
from tessera.lora import LORA_NAME_RE, LORA_NAME_RULE



class AdapterConflict(ValueError):
    """The name is already served from another folder (ALREADY_EXISTS)."""


class AdapterOutsideRoots(ValueError):
    """A run-time load of a folder outside every --lora-root (PERMISSION_DENIED)."""


class LoRADisabled(ValueError):
    """The pod was started without --enable-lora (FAILED_PRECONDITION)."""


class TooManyAdapters(ValueError):
    """The pod already serves max_adapters names (RESOURCE_EXHAUSTED)."""


# Names one pod serves at most: every load report lists them all (the gateway keeps 1,024 a pod).
MAX_SERVED_ADAPTERS = 1024


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """``NAME=PATH`` items of --lora-modules, checked for form and unique names."""
    modules = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not path:
            raise ValueError(f"--lora-modules: {value!r} is not NAME=PATH")
        check_name(name)
        if any(name == n for n, _ in modules):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules.append((name, path))
    return modules


def check_name(name: str) -> None:
    if not LORA_NAME_RE.fullmatch(name):
        raise ValueError(f"lora_name: {name[:64]!r} is not a valid adapter name ({LORA_NAME_RULE})")


class LoRARegistry:
    def __init__(self, processor: Processor, roots: list[str], max_adapters: int = MAX_SERVED_ADAPTERS) -> None:
        self.processor = processor
        self.max_adapters = max_adapters
        self.roots = [Path(r).resolve() for r in roots]
        self._lock = threading.Lock()
        self._by_name: dict[str, AdapterSpec] = {}
        self._ids = itertools.count(1)

    def register(self, name: str, path: str, from_flags: bool = False) -> AdapterSpec:
        """Check and serve the adapter at ``path`` under ``name`` (the same
        name and folder again: a no-op). ValueError (and its subclasses
        above) for every refusal."""
        if self.processor.config.lora is None:
            raise LoRADisabled("this pod serves no LoRA adapters (started without --enable-lora)")
        check_name(name)
        if not from_flags:
            self._check_root(path)
        with self._lock:
            known = self._by_name.get(name)
            if known is not None:
                if Path(known.path).resolve() == Path(path).resolve():
                    return known
                raise AdapterConflict(f"lora_name {name!r} is already served from another folder; unload it first")
            if len(self._by_name) >= self.max_adapters:
                raise TooManyAdapters(f"this pod already serves {self.max_adapters} adapters; unload one first")
            spec = self.processor.process_lora(LoRARequest(name, next(self._ids), path))
            self._by_name[name] = spec
            return spec

    def unregister(self, name: str) -> None:
        """KeyError when no adapter is served under ``name``."""
        with self._lock:
            del self._by_name[name]

    def lookup(self, name: str) -> AdapterSpec | None:
        return self._by_name.get(name)

    def adapters(self) -> list[AdapterSpec]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda s: s.name)

    def _check_root(self, path: str) -> None:
        if not self.roots:
            raise AdapterOutsideRoots("this pod loads adapters at run time only from its --lora-root folders, "
                                      "and has none")
        resolved = Path(path).resolve()
        if not any(resolved.is_relative_to(root) for root in self.roots):
            raise AdapterOutsideRoots(f"lora_path {path!r} is outside this pod's --lora-root folders")
