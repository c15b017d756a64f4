"""Engine configuration: one dataclass per concern, built and validated once."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine_pod.attention.selector import check_backend_name
from engine_pod.lora.config import LoRAConfig
from engine_pod.model.gguf.cache import resolve_model_path
from engine_pod.model.hf_config import ModelArchConfig, dtype_name, load_arch_config, parse_dtype
from engine_pod.spec_decode.config import SpeculativeConfig
from kv_store.block_hash import DEFAULT_BLOCK_SIZE
from kv_store.mac_key import check_mac_key
from kv_store.redis_tier import DEFAULT_KEY_PREFIX, RedisTierConfig
from tessera.context_length import resolve_max_model_len
from tessera.internal_channel import InternalTLS
from tessera.internal_secret import SECRET_ENV, SECRET_FILE_ENV, InternalSecret

if TYPE_CHECKING:
    # Imported where a device or dtype is resolved: a simulated engine
    # (engine_pod/sim) is configured here too and never loads torch.
    import torch


DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class ModelConfig:
    """The checkpoint an engine serves, resolved once from its folder."""

    path: Path
    """The Hugging Face checkpoint folder (config.json, safetensors, tokenizer)."""
    arch: ModelArchConfig
    """The architecture read from config.json (layers, heads, vocabulary, RoPE)."""
    dtype: torch.dtype | None
    """The dtype the weights, activations and KV cache are computed in; None
    in a simulated engine, which computes nothing."""
    max_model_len: int
    """Longest sequence (prompt plus output, in tokens) a request may reach."""

    @property
    def kv_dtype_name(self) -> str:
        """The dtype of the KV blocks, by name: the compute dtype; a simulated
        engine, which computes in none, holds (and stores) its blocks in the
        checkpoint's stored dtype."""
        if self.dtype is not None:
            return dtype_name(self.dtype)
        return self.arch.checkpoint_dtype or "float32"


@dataclass
class CacheConfig:
    """The paged KV cache: its block size, how big the pool is, prefix caching."""

    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV block; also the unit of prefix-cache hits and of the block
    hashes the gateway routes by (kv_store/block_hash.py)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of a prompt prefix another request already computed."""
    num_gpu_blocks: int | None = None
    """A fixed number of KV blocks; None sizes the pool from memory."""
    kv_cache_memory_bytes: int | None = None
    """KV budget in bytes on any device; None: 1 GiB on CPU, profiled on CUDA."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use on CUDA (weights,
    activations and KV cache together)."""

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be an integer in [1, 256], got {self.block_size!r}")
        if self.num_gpu_blocks is not None and (not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks < 1):
            raise ValueError(f"num_gpu_blocks must be a positive integer or None, got {self.num_gpu_blocks!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


class SchedulingPolicy(str, enum.Enum):  # noqa: UP042 - str() of a member stays its repr-like name, as before
    """The order in which waiting requests are admitted, and who is preempted first."""

    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass
class SchedulerConfig:
    """The per-step token budget and the limits the scheduler keeps."""

    max_num_batched_tokens: int = 2048
    """Tokens computed in one step, over every request (the step's budget)."""
    max_num_seqs: int = 256
    """Requests running at once; beyond it new requests wait."""
    max_model_len: int = 2048
    """Longest sequence a request may reach; the scheduler ends it there."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill chunk per step (0: only the budget caps it)."""
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    """fcfs: arrival order; priority: lower priority value first, then arrival
    (and preemption takes the highest value, latest arrival first)."""
    background_priority: int | None = None
    """Requests whose priority is at least this are background work (batch
    jobs): they get nothing in a step while another request waits or
    prefills, and otherwise at most background_max_batched_tokens
    (engine_pod/core/background.py). None: every request is foreground.
    Needs the priority policy."""
    background_max_batched_tokens: int = 256
    """Tokens all background requests together take in one step at most: how
    much longer a step can be when an interactive request arrives behind it."""

    def __post_init__(self) -> None:
        self.policy = SchedulingPolicy(self.policy)
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        self._check_background()

    def _check_background(self) -> None:
        limit = self.background_max_batched_tokens
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"background_max_batched_tokens must be a positive integer, got {limit!r}")
        if self.background_priority is None:
            return
        if isinstance(self.background_priority, bool) or not isinstance(self.background_priority, int) \
                or not -(2**31) <= self.background_priority < 2**31:  # a request's priority is an int32
            raise ValueError(f"background_priority must be an integer in [-2**31, 2**31), "
                             f"got {self.background_priority!r}")
        if self.policy != SchedulingPolicy.PRIORITY:
            raise ValueError("background_priority needs scheduling_policy 'priority' (under fcfs a "
                             "background request at the head of the queue would hold back the others)")


@dataclass
class KVStoreConfig:
    """The tiered KV store this engine shares blocks through (off by default)."""

    host_bytes: int = 0
    """Host-memory tier budget in bytes (0: no host tier)."""
    redis_url: str | None = field(default=None, repr=False)
    """The shared Redis tier (None: none); may hold a password, so never shown."""
    redis_ttl_seconds: int = 3600
    """Seconds a block lives in Redis."""
    redis_cluster: bool = False
    """The URL names a Redis Cluster node."""
    write_queue_size: int = 256
    """Redis write-behind queue length; beyond it writes are dropped (and counted)."""
    redis_key_prefix: str = DEFAULT_KEY_PREFIX
    """Prepended to every Redis key: each InferenceService gets its own, for ACLs."""
    redis_ca_file: str | None = None
    """rediss:// only: the CA bundle that signs the server's certificate."""
    redis_cert_file: str | None = None
    """rediss:// only: the client certificate (PEM)."""
    redis_key_file: str | None = None
    """rediss:// only: the client certificate's private key (PEM)."""
    redis_timeout_seconds: float = RedisTierConfig.timeout_seconds
    """Socket timeout of each Redis call; a slower answer is a miss (recomputed), never a stall."""
    mac_key: bytes | None = field(default=None, repr=False)
    """The key of the MAC over every value in Redis (InternalSecret.kv_mac_key);
    required with a Redis URL."""
    inbox_bytes: int = 0
    """Budget in bytes of the inbox, where prefill pods push a request's
    blocks over the direct P/D channel (0: this pod takes no pushes; its
    requests read Redis). Least recently used blocks go first."""
    direct_timeout_s: float = 60.0
    """Deadline in seconds of one direct push (a prefill pod's side), from its
    first block to the decode pod's reply; past it the blocks go to Redis."""
    peer_tls: InternalTLS | None = None
    """Mutual TLS when this pod dials a peer (a direct push), set by the pod
    from its own TLS flags; None: plaintext, the internal token alone."""

    def __post_init__(self) -> None:
        if not isinstance(self.host_bytes, int) or self.host_bytes < 0:
            raise ValueError(f"kv_host_bytes must be an integer >= 0, got {self.host_bytes!r}")
        if self.write_queue_size < 1:
            raise ValueError(f"kv_write_queue_size must be >= 1, got {self.write_queue_size}")
        if not isinstance(self.inbox_bytes, int) or self.inbox_bytes < 0:
            raise ValueError(f"kv_inbox_bytes must be an integer >= 0, got {self.inbox_bytes!r}")
        if not 0 < self.redis_timeout_seconds <= 600:
            raise ValueError(f"kv_redis_timeout must be in (0, 600] seconds, got {self.redis_timeout_seconds}")
        if not 0 < self.direct_timeout_s <= 3600:
            raise ValueError(f"kv_direct_timeout_s must be in (0, 3600] seconds, got {self.direct_timeout_s}")
        check_mac_key(self.mac_key)
        if self.redis_url is not None:
            self.redis_tier_config()  # validates
            if self.mac_key is None:
                raise ValueError(
                    f"kv_redis_url: the Redis tier needs the deployment's internal secret to authenticate shared KV "
                    f"values; set {SECRET_FILE_ENV} (a file holding it) or {SECRET_ENV}, or pass kv_mac_key")
        if self.inbox_bytes and self.mac_key is None:
            raise ValueError(
                f"kv_inbox_bytes: blocks pushed by other pods are verified with the deployment's internal secret; "
                f"set {SECRET_FILE_ENV} (a file holding it) or {SECRET_ENV}, or pass kv_mac_key")

    def redis_tier_config(self) -> RedisTierConfig:
        """The Redis tier's settings."""
        return RedisTierConfig(self.redis_url, self.redis_ttl_seconds, self.redis_cluster,
                               timeout_seconds=self.redis_timeout_seconds, key_prefix=self.redis_key_prefix,
                               ca_file=self.redis_ca_file, cert_file=self.redis_cert_file,
                               key_file=self.redis_key_file)

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.redis_url is not None or self.inbox_bytes > 0


@dataclass(frozen=True)
class NodeLayout:
    """How the PP x TP ranks of one engine spread over processes that may be
    on different machines (one pod per node, e.g. a LeaderWorkerSet group).
    Node k hosts ranks [k * W / nnodes, (k + 1) * W / nnodes) of the W in
    all; with nnodes = PP each node holds one stage's TP ranks."""

    nnodes: int = 1
    """Processes (pods, nodes) the ranks span; 1: all on this machine."""
    node_rank: int = 0
    """This process's node: 0 is the leader (engine core, scheduler, gRPC
    server and its own ranks); above 0 runs only its local ranks."""
    master_addr: str | None = None
    """Where the leader listens for the other nodes (required when nnodes > 1)."""
    master_port: int = 29500
    """The leader's rendezvous port (torch.distributed TCPStore); the node
    control channel listens on master_port + 1."""
    join_timeout_s: float = 600.0
    """How long the leader waits for every other node to join (and a node for
    the leader to answer) before start-up fails: loading a large checkpoint
    can take minutes."""

    def __post_init__(self) -> None:
        n = self.nnodes
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"nnodes must be a positive integer, got {n!r}")
        k = self.node_rank
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < n:
            raise ValueError(f"node_rank must be in 0..nnodes-1 (nnodes={n}), got {k!r}")
        if n > 1 and not self.master_addr:
            raise ValueError(f"master_addr: required with nnodes={n} (the leader's address the other nodes dial)")
        port = self.master_port
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65535:
            raise ValueError(f"master_port must be in 1-65534 (the node channel takes master_port + 1), got {port!r}")
        if not self.join_timeout_s > 0:
            raise ValueError(f"join_timeout_s must be > 0, got {self.join_timeout_s!r}")

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    def local_ranks(self, world_size: int) -> range:
        """The global ranks this node hosts."""
        return self.local_ranks_of(self.node_rank, world_size)

    def local_ranks_of(self, node_rank: int, world_size: int) -> range:
        """The global ranks node ``node_rank`` hosts."""
        per_node = world_size // self.nnodes
        return range(node_rank * per_node, (node_rank + 1) * per_node)


@dataclass
class ParallelConfig:
    """Tensor and pipeline parallelism: one worker process per rank
    (pipeline_parallel_size x tensor_parallel_size of them) when above 1."""

    tensor_parallel_size: int = 1
    """Ranks the model is split across (heads and MLP columns), one worker process each."""
    worker_threads: int | None = None
    """torch threads per worker process on CPU; None: this process's CPU
    share divided among the ranks."""
    pipeline_parallel_size: int = 1
    """Pipeline stages the decoder layers are split across (vLLM's split:
    equal shares, the remainder one each to the stages before the last),
    each stage tensor_parallel_size ranks; up to one step per stage in
    flight (engine_core.EngineCore._step_pipelined)."""
    nodes: NodeLayout = field(default_factory=NodeLayout)
    """The processes (pods) the ranks span; one by default (``--nnodes``)."""

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        pp = self.pipeline_parallel_size
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
        if self.worker_threads is not None and self.worker_threads < 1:
            raise ValueError(f"worker_threads must be >= 1 or None, got {self.worker_threads!r}")
        if self.world_size % self.nodes.nnodes:
            raise ValueError(f"nnodes={self.nodes.nnodes} does not divide the world size {self.world_size} "
                             f"(pipeline_parallel_size={pp} x tensor_parallel_size={tp}): every node hosts as "
                             "many ranks")

    @property
    def local_world_size(self) -> int:
        """Ranks (worker processes) on this node."""
        return self.world_size // self.nodes.nnodes

    @property
    def world_size(self) -> int:
        """Worker processes (ranks) in all: PP x TP."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def validate_for(self, arch: ModelArchConfig) -> None:
        """Every rank must get an equal share of what the model splits, and
        every pipeline stage at least one layer."""
        pp = self.pipeline_parallel_size
        if pp > arch.num_hidden_layers:
            raise ValueError(
                f"pipeline_parallel_size={pp} exceeds the model's num_hidden_layers={arch.num_hidden_layers} "
                "(every stage needs at least one layer)"
            )
        tp = self.tensor_parallel_size
        if arch.num_attention_heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's num_attention_heads="
                f"{arch.num_attention_heads}"
            )
        kv = arch.num_key_value_heads
        if kv % tp and tp % kv:
            # Fewer KV heads than ranks works by replication only when the
            # ranks group evenly onto them.
            raise ValueError(
                f"tensor_parallel_size={tp} neither divides nor is a multiple of the model's "
                f"num_key_value_heads={kv}"
            )
        if arch.intermediate_size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's intermediate_size={arch.intermediate_size}"
            )


@dataclass
class EngineConfig:
    """Everything an engine is built from, validated by create_engine_config."""

    model: ModelConfig
    """The checkpoint and its resolved dtype and context length."""
    cache: CacheConfig
    """The paged KV cache."""
    scheduler: SchedulerConfig
    """The scheduler's budget and limits."""
    device: torch.device | None
    """Where the model runs (cpu or cuda); None: a simulated engine, whose
    forward is a step-time model (engine_pod/sim)."""
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)
    """The tiered KV store (host memory, Redis); off by default."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor parallelism."""
    attention_backend: str = "auto"
    """auto, torch, triton or cpu (attention/selector.py)."""
    seed: int = 0
    """Seed of torch's global generator in every worker (requests without a seed sample from it)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding; None: none."""
    lora: LoRAConfig | None = None
    """LoRA adapters (enable_lora); None: the base model only."""

    @property
    def simulated(self) -> bool:
        """No model runs: the executor models step times (engine_pod/sim)."""
        return self.device is None


def _resolve_device(device: str | None) -> torch.device:
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device: {device!r} is not a valid torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return dev


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _resolve_dtype(dtype: str | torch.dtype, arch: ModelArchConfig, device: torch.device) -> torch.dtype:
    import torch

    if dtype != "auto":
        return parse_dtype(dtype)
    ckpt = parse_dtype(arch.checkpoint_dtype or "float32")
    if device.type == "cpu":
        # A bf16 checkpoint runs in bf16 where the CPU has bf16 arithmetic
        # (2.5x the float32 GEMM rate here); otherwise half precision is
        # emulated and slow, so compute in float32.
        return torch.bfloat16 if ckpt == torch.bfloat16 and cpu_has_fast_bf16() else torch.float32
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


def _check_device_count(device: torch.device, parallel: ParallelConfig) -> None:
    import torch

    if device.type == "cuda" and parallel.local_world_size > torch.cuda.device_count():
        sizes = f"tensor_parallel_size={parallel.tensor_parallel_size}"
        if parallel.pipeline_parallel_size > 1:
            sizes = f"pipeline_parallel_size={parallel.pipeline_parallel_size} x {sizes}"
        where = f" on each of its {parallel.nodes.nnodes} nodes" if parallel.nodes.nnodes > 1 else ""
        raise ValueError(f"{sizes} needs {parallel.local_world_size} CUDA devices{where}; "
                         f"{torch.cuda.device_count()} visible")


def _check_simulable(dtype, device: str | None, parallel: ParallelConfig,
                     speculative: SpeculativeConfig | None) -> None:
    """What a simulated engine does not model is refused, not silently ignored."""
    if dtype != "auto":
        dtype_name(dtype)  # a bad name is still named as such
        raise ValueError("dtype: a simulated engine computes in no dtype (its KV pool is sized in the checkpoint's "
                         "stored dtype, or set num_gpu_blocks); leave dtype at 'auto'")
    if device not in (None, "auto"):
        raise ValueError(f"device: a simulated engine runs on no device, got {device!r}")
    if parallel.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size: a simulated engine is one process; its profile models the "
                         "step times of whatever parallelism it was fitted on")
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("pipeline_parallel_size: a simulated engine is one process; its profile models the "
                         "step times of whatever parallelism it was fitted on")
    if speculative is not None:
        raise ValueError("speculative_config: a simulated engine does not model speculative decoding")


def _kv_mac_key_from_env() -> bytes | None:
    """The KV MAC key of the deployment's internal secret (env or file), if set."""
    secret = InternalSecret.load()
    return secret.kv_mac_key if secret is not None else None


def create_engine_config(
    model: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    block_size: int = CacheConfig.block_size,
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
    max_num_seqs: int = SchedulerConfig.max_num_seqs,
    long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold,
    num_gpu_blocks: int | None = CacheConfig.num_gpu_blocks,
    kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes,
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
    scheduling_policy: str = SchedulerConfig.policy.value,
    background_priority: int | None = SchedulerConfig.background_priority,
    background_max_batched_tokens: int = SchedulerConfig.background_max_batched_tokens,
    device: str | None = None,
    attention_backend: str = EngineConfig.attention_backend,
    seed: int = EngineConfig.seed,
    kv_host_bytes: int = KVStoreConfig.host_bytes,
    kv_redis_url: str | None = KVStoreConfig.redis_url,
    kv_redis_ttl: int = KVStoreConfig.redis_ttl_seconds,
    kv_redis_cluster: bool = KVStoreConfig.redis_cluster,
    kv_write_queue_size: int = KVStoreConfig.write_queue_size,
    kv_redis_key_prefix: str = KVStoreConfig.redis_key_prefix,
    kv_redis_ca_file: str | None = KVStoreConfig.redis_ca_file,
    kv_redis_cert_file: str | None = KVStoreConfig.redis_cert_file,
    kv_redis_key_file: str | None = KVStoreConfig.redis_key_file,
    kv_redis_timeout: float = KVStoreConfig.redis_timeout_seconds,
    kv_mac_key: bytes | None = KVStoreConfig.mac_key,
    kv_inbox_bytes: int = KVStoreConfig.inbox_bytes,
    kv_direct_timeout_s: float = KVStoreConfig.direct_timeout_s,
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size,
    pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size,
    worker_threads: int | None = ParallelConfig.worker_threads,
    nodes: NodeLayout | None = None,
    speculative_config: SpeculativeConfig | dict | str | None = EngineConfig.speculative,
    enable_lora: bool = False,
    max_loras: int = LoRAConfig.max_loras,
    max_lora_rank: int = LoRAConfig.max_lora_rank,
    max_cpu_loras: int | None = LoRAConfig.max_cpu_loras,
    simulate: bool = False,
) -> EngineConfig:
    """``simulate``: configure a simulated engine (no device, no dtype, no
    torch), whose executor models step times (engine_pod/sim). ``model``: a checkpoint folder,
    or a GGUF file (converted once into a cache folder, engine_pod/model/gguf/cache.py)."""
    path = resolve_model_path(model)
    speculative = SpeculativeConfig.parse(speculative_config)
    # The node layout before the device check: a pod of a multi-node group holds only its own ranks' GPUs.
    parallel = ParallelConfig(tensor_parallel_size, worker_threads, pipeline_parallel_size, nodes or NodeLayout())
    arch = load_arch_config(path)
    parallel.validate_for(arch)
    lora = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
    if simulate:
        _check_simulable(dtype, device, parallel, speculative)
        if lora is not None:
            raise ValueError("enable_lora: a simulated engine runs no adapters")
        dev, model_dtype = None, None
    else:
        dev = _resolve_device(device)
        _check_device_count(dev, parallel)
        model_dtype = _resolve_dtype(dtype, arch, dev)
    if (kv_redis_url is not None or kv_inbox_bytes) and kv_mac_key is None:
        kv_mac_key = _kv_mac_key_from_env()
    kv_store = KVStoreConfig(kv_host_bytes, kv_redis_url, kv_redis_ttl, kv_redis_cluster, kv_write_queue_size,
                             kv_redis_key_prefix, kv_redis_ca_file, kv_redis_cert_file, kv_redis_key_file,
                             kv_redis_timeout, kv_mac_key, kv_inbox_bytes, kv_direct_timeout_s)
    try:
        policy = SchedulingPolicy(scheduling_policy)
    except ValueError:
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}") from None
    check_backend_name(attention_backend)
    # The gateway derives its context limit with the same function (tessera/context_length.py).
    model_len = resolve_max_model_len(max_model_len, arch.raw)
    return EngineConfig(
        model=ModelConfig(path, arch, model_dtype, model_len),
        cache=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_gpu_blocks=num_gpu_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=model_len,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,
            background_priority=background_priority,
            background_max_batched_tokens=background_max_batched_tokens,
        ),
        device=dev,
        kv_store=kv_store,
        parallel=parallel,
        attention_backend=attention_backend,
        seed=seed,
        speculative=speculative,
        lora=lora,
    )
