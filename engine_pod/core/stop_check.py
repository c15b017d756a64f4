"""When a request stops: its stop tokens, max_tokens, max_model_len, and its
grammar (a completed grammar stops it; a refused token aborts it).

The scheduler calls ``append_until_stop`` with each request's emitted tokens
after a step (vLLM's check_stop in v1/core/sched/utils.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_pod.request import Request, RequestStatus

if TYPE_CHECKING:  # the manager pulls in xgrammar: stop checks alone do not need it
    from engine_pod.structured_output.manager import StructuredOutputManager


def check_stop(request: Request, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
    """Whether the request's last output token ends it: (its finished status,
    its stop reason), or (None, None) while it goes on."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens and last in params.all_stop_token_ids:
        # vLLM reports the stop token id as stop_reason, None for EOS.
        reason = last if last in (params.stop_token_ids or ()) else None
        return RequestStatus.FINISHED_STOPPED, reason
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    return None, None


def advance_grammar(
    structured_output: StructuredOutputManager, request: Request, sampled: list[int], status: RequestStatus | None
) -> RequestStatus | None:
    """Feed the sampled tokens to the request's matcher: a completed grammar
    ends the request with "stop"; a refused token (the mask makes that a bug)
    aborts it rather than emit invalid output."""
    if not structured_output.accept_tokens(request.request_id, sampled):
        return RequestStatus.FINISHED_ABORTED
    if status is None and structured_output.is_terminated(request.request_id):
        return RequestStatus.FINISHED_STOPPED
    return status


def append_until_stop(
    request: Request, sampled: list[int], max_model_len: int, structured_output: StructuredOutputManager | None
) -> tuple[list[int], RequestStatus | None, int | None]:
    """Append emitted tokens one by one, as non-speculative decoding would
    have (the grammar, if any, advancing with each); whatever follows a stop
    is dropped. Returns the tokens kept, the finished status and stop reason."""
    for i, token in enumerate(sampled):
        request.append_output_token_ids([token])
        status, stop_reason = check_stop(request, max_model_len)
        if request.use_structured_output:
            if structured_output is None:
                raise RuntimeError("a request with structured outputs in an engine without a manager")
            status = advance_grammar(structured_output, request, [token], status)
        if status is not None:
            return sampled[: i + 1], status, stop_reason
    return sampled, None, None
