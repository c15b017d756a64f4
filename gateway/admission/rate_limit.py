"""Per-tenant rate limits: token buckets for requests and tokens per minute,
and a count of concurrent (admitted or queued) requests."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.tenants import RateLimits

Clock = Callable[[], float]

# Retry hint (seconds) where no bucket tells when retrying will succeed:
# a concurrency slot, a queue place or pool capacity frees when others finish.
RETRY_HINT_S = 1.0

REASONS = ("requests_per_minute", "tokens_per_minute", "concurrency", "shed", "queue_full", "queue_timeout")


class Rejected(Exception):
    """A request not admitted. `message` is client-safe and names the limit;
    `retry_after` is seconds to wait, or None when retrying cannot help."""

    def __init__(self, reason: str, message: str, retry_after: float | None = None):
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"Rejected({self.reason!r}, {self.message!r}, retry_after={self.retry_after!r})"


class TokenBucket:
    """Starts full; refills continuously up to `capacity`."""

    def __init__(self, capacity: float, refill_per_s: float, clock: Clock = time.monotonic):
        if capacity <= 0 or refill_per_s <= 0:
            raise ValueError("token bucket: capacity and refill rate must be > 0")
        self.capacity = float(capacity)
        self.refill_per_s = float(refill_per_s)
        self._clock = clock
        self._tokens = self.capacity
        self._updated = clock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._updated)
        self._tokens = min(self.capacity, self._tokens + elapsed * self.refill_per_s)
        self._updated = now

    @property
    def available(self) -> float:
        self._refill()
        return self._tokens

    def time_until(self, n: float) -> float:
        """Seconds until `n` could be taken (0.0: now); infinite above capacity."""
        if n > self.capacity:
            return float("inf")
        deficit = n - self.available
        return deficit / self.refill_per_s if deficit > 0 else 0.0

    def try_take(self, n: float) -> float | None:
        """Take `n` and return None, or return the wait in seconds without taking."""
        wait = self.time_until(n)
        if wait > 0:
            return wait
        self._tokens -= n
        return None

    def charge(self, n: float) -> None:
        """Take unconditionally: output tokens are known only after the fact,
        so the balance may go negative and delay later requests."""
        self._refill()
        self._tokens -= n

    def refund(self, n: float) -> None:
        """Give back what a request took but never used (it never ran)."""
        self._refill()
        self._tokens = min(self.capacity, self._tokens + n)


class TenantLimiter:
    """One tenant's buckets and in-flight count. `check` then `take`, so a
    request rejected by one limit consumes nothing from the others."""

    def __init__(self, limits: RateLimits, clock: Clock = time.monotonic):
        self._clock = clock
        self.in_flight = 0  # admitted and not released, plus queued
        self.configure(limits)

    def configure(self, limits: RateLimits) -> None:
        """(Re)build the buckets for new limits, keeping the in-flight count."""
        self.limits = limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = TokenBucket(rpm, rpm / 60.0, self._clock) if rpm else None
        self.tokens = TokenBucket(tpm, tpm / 60.0, self._clock) if tpm else None

    def check(self, prompt_tokens: int, output_tokens: int = 0) -> None:
        """Raise Rejected for the first limit the request exceeds. The tokens
        it needs are its prompt plus the output it may generate
        (`output_tokens`: n x max_tokens), reserved at admission."""
        limits = self.limits
        tokens = prompt_tokens + output_tokens
        if self.tokens is not None and tokens > self.tokens.capacity:
            # No wait helps: OpenAI's "Request too large" (429 without Retry-After).
            raise Rejected("tokens_per_minute",
                           f"Request too large for tokens per min (TPM): Limit {limits.tokens_per_minute}, "
                           f"Requested {tokens} ({prompt_tokens} prompt tokens + {output_tokens} output tokens, "
                           "n x max_tokens). Reduce the prompt, max_tokens or n.", None)
        failures: list[tuple[str, str, float]] = []
        if self.requests is not None and (wait := self.requests.time_until(1)) > 0:
            failures.append(("requests_per_minute",
                             f"requests_per_minute limit of {limits.requests_per_minute} exceeded", wait))
        if self.tokens is not None and (wait := self.tokens.time_until(tokens)) > 0:
            failures.append(("tokens_per_minute",
                             f"tokens_per_minute limit of {limits.tokens_per_minute} exceeded (this request "
                             f"needs {tokens} tokens: prompt plus n x max_tokens)", wait))
        if limits.max_concurrent is not None and self.in_flight >= limits.max_concurrent:
            failures.append(("concurrency",
                             f"max_concurrent limit of {limits.max_concurrent} requests reached", RETRY_HINT_S))
        if failures:
            reason, message, _ = failures[0]
            # Retrying earlier than the slowest failing limit would fail again.
            retry_after = max(wait for _, _, wait in failures)
            raise Rejected(reason, f"{message}; retry after {retry_after:.2f} s", retry_after)

    def take(self, tokens: int) -> None:
        """Charge one request and its reserved `tokens` (prompt plus output)."""
        if self.requests is not None:
            self.requests.charge(1)
        if self.tokens is not None:
            self.tokens.charge(tokens)
        self.in_flight += 1

    def refund(self, tokens: int) -> None:
        """Undo `take` for a request that never ran (timed out or cancelled in the queue)."""
        if self.requests is not None:
            self.requests.refund(1)
        if self.tokens is not None:
            self.tokens.refund(tokens)
        self.in_flight -= 1

    def finish(self, unused_tokens: int = 0) -> None:
        """The request ended; give back the part of its reservation it did not generate."""
        if self.tokens is not None and unused_tokens > 0:
            self.tokens.refund(unused_tokens)
        self.in_flight -= 1

    def charge_output(self, n: int) -> None:
        """Output beyond a request's reservation, billed as it is generated."""
        if self.tokens is not None:
            self.tokens.charge(n)
