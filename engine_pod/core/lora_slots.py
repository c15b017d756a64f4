"""Which LoRA adapter sits in which of the runner's ``max_loras`` slots.

The scheduler decides, the runner obeys: each step's SchedulerOutput names
the slot of every scheduled request on an adapter and the adapters to write
into slots first (engine_core attaches their weights). Deciding here keeps
every tensor-parallel rank in step without any of them choosing, and lets
the scheduler hold the invariant the slots need: the running requests use at
most ``max_loras`` adapters, so the adapters of one step always fit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from engine_pod.lora_request import AdapterSpec
from engine_pod.request import Request


class AdapterSource(Protocol):
    """Where adapters are read into host memory (engine/lora_loader.py)."""

    def is_ready(self, spec: AdapterSpec) -> bool:
        """True once the adapter's weights are in host memory; starts reading
        them otherwise. Raises ValueError when they cannot be read."""
        ...

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a read in flight to finish."""
        ...


class LoRASlotTable:
    """Adapter id -> slot, least recently used slots reused first.

    Invariants: at most ``num_slots`` adapters hold slots; an adapter a
    running request uses keeps its slot (assign never evicts one in use)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # lora_int_id -> slot, least recently used first.
        self._slots: OrderedDict[int, int] = OrderedDict()

    def fits(self, request: Request, running: Iterable[Request]) -> bool:
        """Whether ``request`` can join the running ones without their
        adapters exceeding the slots."""
        if request.lora is None:
            return True
        in_use = {r.lora.lora_int_id for r in running if r.lora is not None}
        return request.lora.lora_int_id in in_use or len(in_use) < self.num_slots

    def assign(self, scheduled: Iterable[Request]) -> tuple[dict[str, int], dict[int, int]]:
        """Slots for the adapters of this step's ``scheduled`` requests:
        (request id -> slot, slot -> adapter id to write into it first)."""
        on_adapters = [(r.request_id, r.lora.lora_int_id) for r in scheduled if r.lora is not None]
        needed = {lora_id for _, lora_id in on_adapters}
        loads: dict[int, int] = {}
        for lora_id in sorted(needed):
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
                continue
            slot = self._free_slot(needed)
            self._slots[lora_id] = slot
            loads[slot] = lora_id
        return {req_id: self._slots[lora_id] for req_id, lora_id in on_adapters}, loads

    def _free_slot(self, needed: set[int]) -> int:
        taken = set(self._slots.values())
        for slot in range(self.num_slots):
            if slot not in taken:
                return slot
        for lora_id in self._slots:  # least recently used first
            if lora_id not in needed:
                return self._slots.pop(lora_id)
        raise RuntimeError(f"one step needs more than max_loras={self.num_slots} adapters")
