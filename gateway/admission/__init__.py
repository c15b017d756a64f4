"""Admission control: per-tenant rate limits, pool capacity and the fair queue."""

from gateway.admission.controller import AdmissionController, Ticket
from gateway.admission.fair_queue import FairQueue
from gateway.admission.rate_limit import REASONS, RETRY_HINT_S, Rejected, TenantLimiter, TokenBucket

__all__ = [
    "AdmissionController", "Ticket", "FairQueue", "Rejected", "TokenBucket", "TenantLimiter",
    "REASONS", "RETRY_HINT_S",
]
