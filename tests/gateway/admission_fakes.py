"""What the admission tests share: priority classes, a fake clock, tenants,
and admitting without a running loop."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission import Rejected
from gateway.priority import PriorityClass
from gateway.tenants import RateLimits, Tenant

STANDARD = PriorityClass("standard", priority=10, weight=4.0)
BATCH = PriorityClass("batch", priority=20, weight=1.0, sheddable=True)
HIGH = PriorityClass("high", priority=0, weight=4.0)
LOW = PriorityClass("low", priority=20, weight=1.0)


def tenant(name="acme", rpm=None, tpm=None, concurrent=None) -> Tenant:
    return Tenant(name, None, None, RateLimits(rpm, tpm, concurrent), f"tenant:{name}")


def admit_now(ctrl, who, pclass=STANDARD, prompt_tokens=10, output_tokens=0):
    """Admit without queueing (each call its own short loop; nothing waits)."""
    return asyncio.run(ctrl.admit(who, pclass, prompt_tokens, output_tokens))


def rejection(ctrl, who, pclass=STANDARD, prompt_tokens=10, output_tokens=0) -> Rejected:
    with pytest.raises(Rejected) as info:
        admit_now(ctrl, who, pclass, prompt_tokens, output_tokens)
    return info.value


async def settle() -> None:
    """Let every ready task run until it blocks."""
    for _ in range(5):
        await asyncio.sleep(0)
