"""Engine-core outputs -> user-facing RequestOutputs: detokenization, stop
strings, logprobs and the fan-in of n parallel samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from engine_pod.core.scheduler_output import EngineCoreOutput, Logprobs
from engine_pod.outputs import CompletionOutput, Logprob, RequestOutput
from engine_pod.sampling_params import SamplingParams
from tessera.text import IncrementalDetokenizer


@dataclass
class ParentRequest:
    """A user request; its n samples run as n engine requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[CompletionOutput]
    num_cached_tokens: int = 0
    num_unfinished: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # time.monotonic() stamps, vLLM's RequestMetrics meanings.
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None


@dataclass
class _ChildState:
    parent: ParentRequest
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._children: dict[str, _ChildState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        child_ids: list[str], params: list[SamplingParams],
    ) -> None:
        parent = ParentRequest(request_id, prompt, prompt_token_ids, [], num_unfinished=len(child_ids))
        for index, (child_id, p) in enumerate(zip(child_ids, params)):
            completion = CompletionOutput(
                index, "", [], 0.0 if p.logprobs is not None else None, [] if p.logprobs is not None else None
            )
            parent.completions.append(completion)
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, p.stop, p.include_stop_str_in_output,
                p.skip_special_tokens, p.min_tokens,
            )
            self._children[child_id] = _ChildState(parent, completion, detok, p.logprobs is not None)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns finished user requests and engine requests to abort
        (those a stop string ended)."""
        finished, to_abort = [], []
        for out in outputs:
            state = self._children.get(out.request_id)
            if state is None:
                continue
            completion = state.completion
            if state.parent.first_token_time is None and out.new_token_ids:
                state.parent.first_token_time = time.monotonic()
            completion.token_ids.extend(out.new_token_ids)
            if state.want_logprobs and out.new_logprobs:
                self._add_logprobs(state, out.new_logprobs)
            if out.prompt_logprobs is not None and completion.index == 0:
                state.parent.prompt_logprobs = [None, *(self._step(state, e) for e in out.prompt_logprobs)]
            if completion.index == 0:
                state.parent.num_cached_tokens = out.num_cached_tokens
            stop_str = state.detokenizer.update(out.new_token_ids)
            completion.text = state.detokenizer.output_text
            if stop_str is not None:
                completion.finish_reason, completion.stop_reason = "stop", stop_str
                if not out.finished:
                    to_abort.append(out.request_id)  # free its KV blocks now
            elif out.finished:
                completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
            if completion.finish_reason is not None:
                del self._children[out.request_id]
                state.parent.num_unfinished -= 1
                if state.parent.num_unfinished == 0:
                    finished.append(self._make_output(state.parent))
        return finished, to_abort

    def _add_logprobs(self, state: _ChildState, entries: list[Logprobs]) -> None:
        completion = state.completion
        for entry in entries:
            completion.logprobs.append(self._step(state, entry))
            completion.cumulative_logprob += entry.logprobs[0]

    @staticmethod
    def _step(state: _ChildState, entry: Logprobs) -> dict[int, Logprob]:
        step: dict[int, Logprob] = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in step:
                step[token_id] = Logprob(logprob, rank, state.detokenizer.decode_token(token_id))
        return step

    def abort(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self._children.pop(req_id, None)

    @staticmethod
    def _make_output(parent: ParentRequest) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=parent.completions,
            finished=True,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=parent.prompt_logprobs,
            metrics={
                "arrival_time": parent.arrival_time,
                "first_token_time": parent.first_token_time,
                "finished_time": time.monotonic(),
            },
        )
