"""An async streaming client for any OpenAI-compatible server (aiohttp: one
connection pool for many concurrent streams, no per-request threads).

Every request streams (`stream: true`, with `stream_options.include_usage`
so the server's own token counts come back) and is greedy. Its output length
is fixed with `max_tokens` plus vLLM's `ignore_eos` where the server takes
it. A request that fails, however it fails, comes back as an outcome with
an error: one bad request never stops a run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import aiohttp

from tessera_tools.bench.serve.dataset import ServeRequest
from tessera_tools.bench.serve.stream import DONE, RequestOutcome, StreamRecorder

ENDPOINT_PATHS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass(frozen=True)
class Target:
    """Where requests go and how they are shaped."""

    base_url: str  # ends in /v1
    endpoint: str  # "completions" or "chat"
    model: str
    ignore_eos: bool = True

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]

    def body(self, request: ServeRequest, max_tokens: int | None = None) -> dict:
        body: dict = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                      "temperature": 0.0}
        limit = max_tokens or request.output_len
        if self.endpoint == "chat":
            body["messages"] = request.messages or [{"role": "user", "content": request.prompt}]
            body["max_completion_tokens"] = limit
        else:
            body["prompt"] = request.prompt
            body["max_tokens"] = limit
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


def _sse_payload(line: bytes) -> str | None:
    """The payload of an SSE `data:` line; None for anything else (blank
    separators, comments, event names)."""
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip().decode("utf-8")


class ServeClient:
    """One HTTP session for a whole benchmark; use as an async context manager."""

    def __init__(self, base_url: str, api_key: str | None = None, request_timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ServeClient:
        # limit=0: no cap on open connections; the benchmark's own
        # --max-concurrency is the only cap, so the pool never queues requests.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self._timeout,
                                              headers=self._headers)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def model_ids(self) -> list[str]:
        """The ids GET /v1/models lists (raises with the server's answer on failure)."""
        async with self._session.get(self.base_url + "/models") as resp:
            text = await resp.text()
            if resp.status != 200:
                hint = " (--base-url is the API root, e.g. http://HOST:PORT/v1)" if resp.status == 404 else ""
                raise RuntimeError(f"GET {self.base_url}/models: HTTP {resp.status}: {text[:300]}{hint}")
        return [m["id"] for m in json.loads(text).get("data", [])]

    async def call(self, method: str, path: str, **kwargs) -> tuple[int, bytes]:
        """A plain (non-streamed) call under the API root: its status and body.
        kwargs go to aiohttp (json=..., data=... for a multipart form)."""
        async with self._session.request(method, self.base_url + path, **kwargs) as resp:
            return resp.status, await resp.read()

    async def send(self, target: Target, request: ServeRequest, max_tokens: int | None = None,
                   recorder: StreamRecorder | None = None) -> RequestOutcome:
        """One streamed request, timed from the moment it is sent; a caller
        that wants more than the outcome passes its own (sub)class of recorder."""
        recorder = recorder or StreamRecorder(time.perf_counter(), request.prompt_len)
        try:
            async with self._session.post(target.url, json=target.body(request, max_tokens)) as resp:
                if resp.status != 200:
                    recorder.fail(time.perf_counter(), f"HTTP {resp.status}: {(await resp.text())[:300]}")
                    return recorder.outcome()
                async for line in resp.content:
                    payload = _sse_payload(line)
                    if payload is None:
                        continue
                    at = time.perf_counter()
                    recorder.on_event(at, DONE if payload == DONE else json.loads(payload))
                    if payload == DONE:
                        break
        except Exception as e:  # timeouts, resets, bad JSON: this request failed, the run goes on
            recorder.fail(time.perf_counter(), f"{type(e).__name__}: {e}"[:300])
        return recorder.outcome()
