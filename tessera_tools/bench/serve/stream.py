"""One streamed request as the client sees it: timestamped SSE events in,
the request's TTFT, inter-token latencies, end-to-end latency and token
counts out (the per-request definitions of `vllm bench serve`).

- TTFT: request sent -> the first chunk that carries a token.
- ITL: the gaps between successive token-carrying chunks (a chunk that
  holds several tokens is one gap, as the client sees it).
- E2E latency: request sent -> the end of the stream (`data: [DONE]`).
- TPOT: (E2E - TTFT) / (output tokens - 1), for outputs of 2+ tokens.
- Output tokens: `usage.completion_tokens` of the usage chunk when the
  server sends one, else the number of token-carrying chunks.

A chunk carries a token when its first choice has non-empty `text`
(completions) or `delta.content` (chat), or an empty one while the choice is
still open (finish_reason null): servers send one chunk per token, and a
token that decodes to nothing (a partial UTF-8 sequence held back, a skipped
special token) still took its decode step. Not tokens: a chat opener that
holds only the role, and an empty closing chunk that only brings the
finish_reason. If no chunk qualifies at all, the first chunk with a choice
stands in for the first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DONE = "[DONE]"


@dataclass
class RequestOutcome:
    """What one request measured (seconds); `error` is set when it failed."""

    ttft_s: float = math.nan
    e2el_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for 0- or 1-token outputs."""
        if self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def carries_token(choice: dict) -> bool:
    """Whether a streamed choice holds a generated token (see above)."""
    still_open = choice.get("finish_reason") is None
    if "delta" in choice:  # chat
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content:
            return True
        # An empty content counts while open, except in the role-only opener.
        return content is not None and still_open and "role" not in delta
    text = choice.get("text")
    return bool(text) or (text is not None and still_open)


class StreamRecorder:
    """Fed the events of one stream as they arrive (or replayed from a
    recording); `outcome()` gives the request's measurements."""

    def __init__(self, sent_at: float, prompt_len: int | None = None) -> None:
        self.sent_at = sent_at
        self._fallback_prompt_len = prompt_len or 0
        self._token_times: list[float] = []
        self._first_choice_at: float | None = None
        self._usage: dict | None = None
        self._ended_at: float | None = None
        self._error: str | None = None

    def on_event(self, at: float, event: dict | str) -> None:
        """One SSE `data:` payload: a parsed JSON chunk, or the string "[DONE]"."""
        if event == DONE:
            self._ended_at = at
            return
        if "error" in event:
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self.fail(at, f"server error mid-stream: {message}")
            return
        choices = event.get("choices") or []
        if choices:
            if self._first_choice_at is None:
                self._first_choice_at = at
            if carries_token(choices[0]):
                self._token_times.append(at)
        if event.get("usage"):
            self._usage = event["usage"]

    def fail(self, at: float, error: str) -> None:
        if self._error is None:  # the first cause is the one worth reporting
            self._error = error
        self._ended_at = at

    def outcome(self) -> RequestOutcome:
        if self._error is not None:
            return RequestOutcome(e2el_s=self._elapsed(self._ended_at), error=self._error)
        if self._ended_at is None:
            return RequestOutcome(error="the stream ended before [DONE]")
        times = self._token_times or ([self._first_choice_at] if self._first_choice_at is not None else [])
        if not times:
            return RequestOutcome(e2el_s=self._elapsed(self._ended_at), error="the stream carried no tokens")
        usage = self._usage or {}
        return RequestOutcome(
            ttft_s=times[0] - self.sent_at,
            e2el_s=self._ended_at - self.sent_at,
            itl_s=[b - a for a, b in zip(times, times[1:])],
            prompt_tokens=usage.get("prompt_tokens") or self._fallback_prompt_len,
            output_tokens=usage.get("completion_tokens") or len(times),
        )

    def _elapsed(self, at: float | None) -> float:
        return math.nan if at is None else at - self.sent_at


def replay(sent_at: float, events: list[tuple[float, dict | str]], prompt_len: int | None = None) -> RequestOutcome:
    """The outcome of a recorded stream: (timestamp, event) pairs in order."""
    recorder = StreamRecorder(sent_at, prompt_len)
    for at, event in events:
        recorder.on_event(at, event)
    return recorder.outcome()
