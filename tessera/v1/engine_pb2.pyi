from tessera.v1 import structured_output_pb2 as _structured_output_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "structured_outputs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured_outputs: _structured_output_pb2.StructuredOutputs
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[_structured_output_pb2.StructuredOutputs, _Mapping]] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("mode", "direct_target")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_NONE: _ClassVar[KVTransferParams.Mode]
        MODE_PRODUCE: _ClassVar[KVTransferParams.Mode]
        MODE_CONSUME: _ClassVar[KVTransferParams.Mode]
    MODE_NONE: KVTransferParams.Mode
    MODE_PRODUCE: KVTransferParams.Mode
    MODE_CONSUME: KVTransferParams.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    DIRECT_TARGET_FIELD_NUMBER: _ClassVar[int]
    mode: KVTransferParams.Mode
    direct_target: str
    def __init__(self, mode: _Optional[_Union[KVTransferParams.Mode, str]] = ..., direct_target: _Optional[str] = ...) -> None: ...

class KVBlock(_message.Message):
    __slots__ = ("block_hash", "value")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    value: bytes
    def __init__(self, block_hash: _Optional[bytes] = ..., value: _Optional[bytes] = ...) -> None: ...

class PushKVBlocksRequest(_message.Message):
    __slots__ = ("transfer_id", "blocks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[KVBlock]
    def __init__(self, transfer_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[KVBlock, _Mapping]]] = ...) -> None: ...

class PushKVBlocksReply(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class OpenKVInboxRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class OpenKVInboxReply(_message.Message):
    __slots__ = ("port", "ticket", "expires_in_ms")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    expires_in_ms: int
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., expires_in_ms: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "priority", "cache_salt", "kv_transfer", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    priority: int
    cache_salt: str
    kv_transfer: KVTransferParams
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., kv_transfer: _Optional[_Union[KVTransferParams, _Mapping]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time")
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    FIRST_SCHEDULED_TIME_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    last_token_time: float
    def __init__(self, arrival_time: _Optional[float] = ..., first_scheduled_time: _Optional[float] = ..., first_token_time: _Optional[float] = ..., last_token_time: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "stop_token_id", "num_cached_tokens", "num_prompt_tokens", "timing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: str
    stop_token_id: int
    num_cached_tokens: int
    num_prompt_tokens: int
    timing: Timing
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("block_hashes", "interval_ms", "prefix_cache_keys")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_KEYS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    interval_ms: int
    prefix_cache_keys: bool
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., interval_ms: _Optional[int] = ..., prefix_cache_keys: _Optional[bool] = ...) -> None: ...

class PrefixCacheKeys(_message.Message):
    __slots__ = ("reset", "stored", "removed")
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reset: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("role", "num_running", "num_waiting", "kv_cache_usage", "num_kv_blocks", "num_free_kv_blocks", "block_size", "matched_prefix_blocks", "serving", "stalled", "prefix_cache", "num_pending_prefill_tokens", "lora_adapters")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    role: str
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_kv_blocks: int
    block_size: int
    matched_prefix_blocks: int
    serving: bool
    stalled: bool
    prefix_cache: PrefixCacheKeys
    num_pending_prefill_tokens: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    def __init__(self, role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_kv_blocks: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., matched_prefix_blocks: _Optional[int] = ..., serving: _Optional[bool] = ..., stalled: _Optional[bool] = ..., prefix_cache: _Optional[_Union[PrefixCacheKeys, _Mapping]] = ..., num_pending_prefill_tokens: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "fingerprint", "resident")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    resident: bool
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., resident: _Optional[bool] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoRAAdapterList(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ...) -> None: ...
