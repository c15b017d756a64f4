"""One step's scheduling decisions as the SchedulerOutput the runner reads:
requests it has not seen in full, the ones it holds as what changed."""

from __future__ import annotations

from engine_pod.core.kv_cache_manager import KVCacheManager
from engine_pod.core.scheduler_output import (
    CachedRequestData,
    KVConnectorMetadata,
    NewRequestData,
    SchedulerOutput,
)
from engine_pod.request import Request


def build_scheduler_output(
    kv: KVCacheManager,
    scheduled_new: list[Request],
    scheduled_running: list[Request],
    num_scheduled: dict[str, int],
    new_blocks: dict[str, list[int]],
    preempted: list[Request],
    finished_req_ids: set[str],
    kv_connector: KVConnectorMetadata | None,
) -> SchedulerOutput:
    """``scheduled_new`` were admitted from the waiting queue this step (fresh
    or resumed after preemption), ``scheduled_running`` were running already
    and got ``new_blocks``; ``num_scheduled`` is every request's token count.
    Every scheduled request's tokens reach the runners once: a new one's
    prompt, a held one's tokens since it was last scheduled."""
    new_reqs: list[NewRequestData] = []
    cached_reqs: list[CachedRequestData] = []
    for request in scheduled_new:
        if request.num_preemptions:
            # Resumed after preemption: the runner still holds its state
            # (tokens, sampling generator); it gets a fresh block table.
            cached_reqs.append(_held_request(request, kv.get_block_ids(request.request_id), resumed=True))
        else:
            new_reqs.append(
                NewRequestData(
                    request.request_id, request.prompt_token_ids, request.sampling_params,
                    kv.get_block_ids(request.request_id), request.num_computed_tokens,
                )
            )
            request.num_tokens_sent = request.num_prompt_tokens
    for request in scheduled_running:
        cached_reqs.append(_held_request(request, new_blocks[request.request_id], resumed=False))
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached_reqs,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=finished_req_ids,
        preempted_req_ids={r.request_id for r in preempted},
        kv_connector=kv_connector,
    )


def _held_request(request: Request, block_ids: list[int], resumed: bool) -> CachedRequestData:
    """A request the runners hold, with the tokens they were not sent yet."""
    sent = request.num_tokens_sent
    data = CachedRequestData(
        request.request_id, block_ids, request.num_computed_tokens, request.num_prompt_tokens,
        resumed_from_preemption=resumed, new_token_ids=request.all_token_ids[sent:], new_token_index=sent,
    )
    request.num_tokens_sent = request.num_tokens
    return data
