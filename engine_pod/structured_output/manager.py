"""Structured outputs in the engine core: compile grammars off the engine
loop, keep one matcher per request, build each step's bitmask.

Compilation runs on a small thread pool so a large schema never stalls the
step loop: its request waits (RequestStatus.WAITING_FOR_FSM) while others
run. Compiled grammars are cached by constraint, so a schema sent again
compiles zero times. All matcher calls happen on the engine loop's thread.

xgrammar (and the transformers it imports: about a second) is imported with
the backend, on the first grammar: an engine starts without it (an engine pod
imports it in the background once it serves: server/main.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine_pod.request import Request
from engine_pod.structured_output.bitmask import GrammarBitmask
from tessera.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from engine_pod.structured_output.backend_xgrammar import Grammar, XgrammarBackend

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first): a compiled
# JSON grammar holds per-state token masks, so an unbounded cache would grow
# with every distinct schema clients send.
MAX_CACHED_GRAMMARS = 256


@dataclass
class StructuredOutputStats:
    num_requests: int = 0
    num_compiles: int = 0
    num_cache_hits: int = 0
    compile_seconds: float = 0.0


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str | Path, vocab_size: int, stop_token_ids: set[int],
                 max_workers: int = 1, max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.stats = StructuredOutputStats()
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self.max_cached = max_cached
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        # request id -> its compile, until the matcher exists
        self._pending: dict[str, Future] = {}
        self._grammars: dict[str, Grammar] = {}

    # -- compile (off the loop) ------------------------------------------
    def _get_backend(self) -> XgrammarBackend:
        # Built on first use, in a compile thread: loading the tokenizer and
        # indexing its vocabulary takes a while on large vocabularies.
        with self._backend_lock:
            if self._backend is None:
                from engine_pod.structured_output.backend_xgrammar import XgrammarBackend
                from tessera.text import load_tokenizer

                self._backend = XgrammarBackend(
                    load_tokenizer(self.tokenizer_path), self.vocab_size, sorted(self.stop_token_ids)
                )
            return self._backend

    def _compile(self, params: StructuredOutputsParams):
        start = time.perf_counter()
        compiled = self._get_backend().compile(params)
        self.stats.compile_seconds += time.perf_counter() - start
        return compiled

    def add_request(self, request: Request) -> None:
        """Start (or reuse) the compile of the request's grammar."""
        params = request.sampling_params.structured_outputs
        self.stats.num_requests += 1
        future = self._compiled.get(params.key)
        if future is None or (future.done() and future.exception() is not None):
            self.stats.num_compiles += 1
            future = self._executor.submit(self._compile, params)
            self._compiled[params.key] = future
            if len(self._compiled) > self.max_cached:
                self._compiled.popitem(last=False)  # its requests still hold their future
        else:
            self.stats.num_cache_hits += 1
            self._compiled.move_to_end(params.key)
        self._pending[request.request_id] = future

    def is_ready(self, request: Request) -> bool:
        """Whether the request's grammar is compiled (its matcher then exists).
        A failed compile raises its error (admission checks make it rare)."""
        future = self._pending.get(request.request_id)
        if future is None:
            return request.request_id in self._grammars
        if not future.done():
            return False
        from engine_pod.structured_output.backend_xgrammar import Grammar  # imported by the compile

        del self._pending[request.request_id]
        self._grammars[request.request_id] = Grammar.create(future.result())
        return True

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to timeout for any pending compile (when nothing else can run)."""
        pending = set(self._pending.values())
        if pending:
            wait(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def free_request(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._grammars.pop(request_id, None)

    # -- per step (on the loop) -------------------------------------------
    @property
    def has_matchers(self) -> bool:
        """Whether any request holds a matcher (else a step has no grammar work)."""
        return bool(self._grammars)

    def grammar_bitmask(self, request_ids: list[str], drafts: dict[str, list[int]] | None = None
                        ) -> GrammarBitmask | None:
        """The next-token masks of the given requests that have a grammar.
        With drafts (speculative decoding), a request gets 1 + len(drafts)
        rows: the mask after each accepted prefix of its drafts."""
        guided = [r for r in request_ids if r in self._grammars]
        if not guided:
            return None
        drafts = drafts or {}
        backend = self._get_backend()
        bitmask = backend.allocate_bitmask(sum(1 + len(drafts.get(r, ())) for r in guided))
        row_owners: list[str] = []
        for req_id in guided:
            grammar = self._grammars[req_id]
            request_drafts = drafts.get(req_id, [])
            start = len(row_owners)
            if request_drafts:
                grammar.fill_bitmasks(bitmask, start, request_drafts)
            else:
                grammar.fill_bitmask(bitmask, start)
            row_owners.extend([req_id] * (1 + len(request_drafts)))
        return GrammarBitmask(row_owners, bitmask.numpy())

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the request's matcher; False if the grammar refuses a token."""
        grammar = self._grammars.get(request_id)
        if grammar is None:
            return True
        accepted = grammar.accept_tokens(token_ids)
        if not accepted:
            logger.error("request %s: sampled tokens %s outside its grammar", request_id, token_ids)
        return accepted

    def validate_tokens(self, request_id: str, token_ids: list[int]) -> int:
        """How many leading draft tokens the request's grammar accepts (its
        matcher unchanged); all of them for a request without a grammar."""
        grammar = self._grammars.get(request_id)
        return len(token_ids) if grammar is None else grammar.validate_tokens(token_ids)

    def is_terminated(self, request_id: str) -> bool:
        grammar = self._grammars.get(request_id)
        return grammar is not None and grammar.is_terminated()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
