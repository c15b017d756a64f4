"""Between the Engine proto and the engine's own types.

Every check that can fail raises ValueError naming the field, which the
service turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import re

from engine_pod.core.scheduler_output import EngineCoreOutput
from engine_pod.lora_request import AdapterSpec
from engine_pod.processor import Processor
from engine_pod.request import Request
from engine_pod.sampling_params import SamplingParams
from tessera.structured_output import params_from_proto
from tessera.v1 import engine_pb2 as pb

_KNOWN_MODES = set(pb.KVTransferParams.Mode.values())


def sampling_params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Proto3 zeros mean "unset" where the proto says so (top_p, top_k,
    repetition_penalty, max_tokens)."""
    if p.max_tokens < 0:
        raise ValueError(f"sampling_params.max_tokens must be >= 0 (0: up to max_model_len), got {p.max_tokens}")
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p != 0 else 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0 else 1.0,
        max_tokens=p.max_tokens or None,
        min_tokens=p.min_tokens,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        structured_outputs=params_from_proto(p.structured_outputs) if p.HasField("structured_outputs") else None,
    )


# Which P/D modes each pod role accepts.
_ROLE_MODES = {
    "mixed": {pb.KVTransferParams.MODE_NONE, pb.KVTransferParams.MODE_PRODUCE, pb.KVTransferParams.MODE_CONSUME},
    "prefill": {pb.KVTransferParams.MODE_NONE, pb.KVTransferParams.MODE_PRODUCE},
    "decode": {pb.KVTransferParams.MODE_NONE, pb.KVTransferParams.MODE_CONSUME},
}


def request_from_proto(
    msg: pb.GenerateRequest, request_id: str, processor: Processor, role: str, shared_kv_store: bool,
    adapter: AdapterSpec | None = None,
) -> Request:
    """``adapter``: the one ``msg.lora_name`` names (the caller looked it up).
    ValueError: bad input (INVALID_ARGUMENT); NotImplementedError: a mode this
    pod cannot serve (FAILED_PRECONDITION)."""
    mode = msg.kv_transfer.mode
    if mode not in _KNOWN_MODES:
        raise ValueError(f"kv_transfer.mode: unknown value {mode}; known: {sorted(_KNOWN_MODES)}")
    if mode not in _ROLE_MODES[role]:
        mode_name = pb.KVTransferParams.Mode.Name(mode)
        raise NotImplementedError(f"kv_transfer.mode: {mode_name} is not served by a {role} pod")
    if mode != pb.KVTransferParams.MODE_NONE and not shared_kv_store:
        raise NotImplementedError("kv_transfer.mode: P/D transfer needs a shared KV store (--kv-redis-url)")
    prompt = processor.process_prompt({"prompt_token_ids": list(msg.prompt_token_ids)})
    params = processor.process_params(sampling_params_from_proto(msg.sampling_params))
    produce = mode == pb.KVTransferParams.MODE_PRODUCE
    target = direct_target(msg.kv_transfer.direct_target, produce)
    if produce:
        # A prefill pod computes the prompt and reports its first token only;
        # the decode pod samples every output token (the first included), so
        # a grammar here would only cost a compile.
        params.max_tokens, params.min_tokens = 1, 0
        params.structured_outputs = None
    return Request(
        request_id, prompt.prompt_token_ids, params, priority=msg.priority, cache_salt=msg.cache_salt or None,
        kv_transfer_mode="produce" if produce else None, kv_transfer_target=target, lora=adapter,
    )


# host:port, the host a name, an IPv4 address or a bracketed IPv6 one.
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):([0-9]{1,5})$")


def direct_target(target: str, produce: bool) -> str | None:
    """The decode pod a producing request pushes its blocks to (None: Redis);
    ValueError for anything but a host:port on a producing request."""
    if not target:
        return None
    if not produce:
        raise ValueError("kv_transfer.direct_target: only a MODE_PRODUCE request pushes its blocks")
    match = _ADDRESS.match(target) if len(target) <= 261 else None
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"kv_transfer.direct_target: {target[:64]!r} is not a host:port address")
    return target


def response_from_output(out: EngineCoreOutput, num_prompt_tokens: int) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        finish_reason=out.finish_reason or "",
        num_cached_tokens=out.num_cached_tokens,
        num_prompt_tokens=num_prompt_tokens,
    )
    if isinstance(out.stop_reason, int):
        resp.stop_token_id = out.stop_reason
    for lp in out.new_logprobs or ():
        entries = [pb.TokenLogprob(token_id=t, logprob=v, rank=r)
                   for t, v, r in zip(lp.token_ids, lp.logprobs, lp.ranks)]
        resp.logprobs.append(pb.TokenLogprobs(entries=entries))
    return resp
