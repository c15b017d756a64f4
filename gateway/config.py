"""The gateway's configuration: one YAML file (`tessera gateway --config FILE`).

The operator renders this file from the InferenceService spec into a
ConfigMap; `tessera up` writes it for local runs. Unknown keys are errors,
so a typo never silently disables a setting.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gateway.tool_calls.parsers import parser_names
from kv_store.block_hash import DEFAULT_BLOCK_SIZE
from kv_store.redis_tier import check_key_prefix, check_redis_url, check_tls_files
from tessera.internal_channel import InternalTLS
from tessera.lora import LORA_NAME_RE, LORA_NAME_RULE
from tessera.roles import POD_ROLES

# "score": KV-aware scoring of every pod (gateway/router.py); "bounded": the
# same scoring of a few candidates, so its cost does not grow with the fleet;
# "round_robin": a baseline that ignores prefixes and load, for benchmarks
# and A/B comparisons.
ROUTER_POLICIES = ("score", "bounded", "round_robin")
# Where the router learns which prompt blocks a pod holds: "query" asks the
# scored pods per request (Engine.GetLoad); "pushed" reads what each pod
# pushes on its load stream (gateway/pods/prefix_index.py), no call per request.
PREFIX_MATCH_SOURCES = ("query", "pushed")
# Each affinity candidate covers one more doubling of a prompt (the ladder
# of gateway/router.py): 16 reach a 65536-fold growth, far past any context.
MAX_AFFINITY_CANDIDATES = 16


class GatewayConfigError(ValueError):
    pass


def lora_name_problem(name: object, base: str) -> str | None:
    """Why `name` cannot name a LoRA adapter of the base model `base`, or
    None: the one rule for the config's `model.loras` and the admin endpoint."""
    if not isinstance(name, str) or not LORA_NAME_RE.fullmatch(name):
        shown = name[:64] if isinstance(name, str) else name
        return f"{shown!r} is not a valid adapter name ({LORA_NAME_RULE})"
    if name == base:
        return f"{name!r} is the base model's name; an adapter needs a name of its own"
    return None


@dataclass(frozen=True)
class LoRAConfig:
    """A LoRA adapter the gateway serves under its own model name."""

    name: str
    """The OpenAI `model` value that selects it (and the name the engine pods
    serve it under: its folder is the pods' business, `--lora-modules NAME=PATH`)."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: str
    # None: the engine's limit, from the checkpoint's config.json
    # (max_position_embeddings capped at a sliding window: tessera/context_length.py).
    max_model_len: int | None = None
    # Must equal the engine pods' --block-size: the router hashes with it.
    block_size: int = DEFAULT_BLOCK_SIZE
    loras: tuple[LoRAConfig, ...] = ()
    """LoRA adapters of this model the pods serve, by name: each is a model of
    its own to clients (`GET /v1/models`, with `parent` the base). The gateway
    also learns adapters from the pods' load reports and from its admin
    endpoint (docs/gateway.md); names only, the folders live on the pods."""
    lora_admin_timeout_s: float = 30.0
    """Seconds the admin endpoints (/v1/load_lora_adapter, /v1/unload_lora_adapter)
    wait for each pod (a load reads and checks the adapter's files); a pod
    that does not answer in time counts as failed (504)."""
    tool_call_parser: str | None = None
    """How tool_choice "auto" finds the calls in this model's text: a parser's
    name (gateway/tool_calls/parsers: "hermes", "llama3_json"), chosen for the
    model family's format. None: "auto" is refused (400); "required", a named
    function and "none" need no parser."""


@dataclass(frozen=True)
class ServerConfig:
    # Every listener binds this address.
    host: str = "0.0.0.0"
    # The public REST API (OpenAI-compatible) and gRPC tessera.v1.Inference.
    http_port: int = 8000
    grpc_port: int = 50051
    # Prometheus /metrics, on a port of its own so the public ports never
    # expose them (they name every tenant); 0: not served.
    metrics_port: int = 9090
    # Seconds an idle HTTP keep-alive connection stays open. Longer than the
    # idle timeout of the clients and load balancers in front (60 s is
    # common), so they close first: a server that closes first races the
    # client's next request on that connection, which then fails with a
    # connection reset (uvicorn's default of 5 s did, for clients pausing 5 s).
    keep_alive_s: float = 75.0

    def __post_init__(self) -> None:
        if not self.keep_alive_s > 0:
            raise GatewayConfigError("server.keep_alive_s must be > 0")
        for name in ("http_port", "grpc_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise GatewayConfigError(f"server.{name} must be in [0, 65535]")
        if self.metrics_port and self.metrics_port in (self.http_port, self.grpc_port):
            raise GatewayConfigError("server.metrics_port must differ from server.http_port and server.grpc_port")


@dataclass(frozen=True)
class StaticPod:
    address: str
    role: str = "mixed"


@dataclass(frozen=True)
class KubernetesDiscovery:
    namespace: str
    # role -> Service name whose EndpointSlices list the pool's pods.
    services: dict[str, str]
    port_name: str = "grpc"
    # Re-list interval when the watch breaks.
    resync_s: float = 30.0


@dataclass(frozen=True)
class FileDiscovery:
    # A YAML file mapping each role to its pods' host:port addresses, read
    # again whenever it changes (gateway/pods/discovery.py): pools that grow
    # and shrink outside Kubernetes (a fleet benchmark, a static deployment
    # edited in place).
    path: str
    # Seconds between looks at the file's modification time and size.
    poll_interval_s: float = 0.5


@dataclass(frozen=True)
class PodsConfig:
    static: tuple[StaticPod, ...] = ()
    kubernetes: KubernetesDiscovery | None = None
    file: FileDiscovery | None = None


@dataclass(frozen=True)
class AdmissionConfig:
    # A pod is saturated when its waiting queue or KV usage reaches these.
    max_waiting_per_pod: int = 8
    max_kv_usage: float = 0.95
    max_queue_len: int = 1024
    queue_timeout_s: float = 60.0
    # With no engine pod routable (a pool scaled to zero, pods starting or all
    # gone), queue requests as at full capacity (within max_queue_len and
    # queue_timeout_s) instead of answering 503 at once: the queue length is
    # the demand the operator's autoscaler lifts a pool from zero on.
    queue_without_pods: bool = False


@dataclass(frozen=True)
class RouterWeights:
    """The score's weights (gateway/router.py); all >= 0."""

    prefix: float = 1.0
    """Per share of the prompt's tokens in the pod's prefix cache."""
    prefill_backlog: float = 0.5
    """Per share of the prompt's length the pod must prefill before it (its pending prefill tokens).
    At half of `prefix` a pod holding the prefix wins while its backlog is under twice what its cache
    saves: sending the prompt to a cold pod costs the fleet that prefill, and a report up to one
    interval old still counts prompts prefilled since."""
    waiting: float = 0.5
    """Per waiting request, as a share of admission.max_waiting_per_pod."""
    running: float = 0.2
    """Per running request, as a share of router.running_norm."""
    kv_usage: float = 0.3
    """Per fraction of the pod's KV blocks in use."""
    lora_resident: float = 0.25
    """Added for a request on a LoRA adapter whose weights the pod holds in host memory (its
    report's `resident`): about four waiting requests' worth (at max_waiting_per_pod 8), so an
    adapter's requests stay on the pods holding it until those are that much busier than
    another pod, which then takes them and loads the adapter: a popular adapter spreads."""


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "score"
    weights: RouterWeights = RouterWeights()
    # Divides running requests in the score: a pod running this many counts 1.
    running_norm: int = 32
    # How often pods push their load (StreamLoad) and how long a prefix query may take.
    load_interval_ms: int = 200
    prefix_query_timeout_ms: int = 50
    # Seconds between reconnect attempts to an ejected pod.
    reprobe_interval_s: float = 1.0
    # Seconds without a load report before a pod counts as stalled (a stopped
    # process keeps its connection open, so nothing fails by itself): it is
    # ejected and its in-flight calls end. 25 reports at the default interval:
    # a busy but live pod never misses that many (its reports come from the
    # event loop, apart from the engine thread), and a false stall would fail
    # every stream on the pod, far worse than a frozen pod's 5 s.
    load_timeout_s: float = 5.0
    # Seconds one engine call may go without a response before it ends
    # (retried elsewhere if nothing was streamed yet): a backstop behind the
    # load reports. Generous, since a long prefill on CPU says nothing until done.
    stream_idle_timeout_s: float = 120.0
    # policy "bounded" only: pods asked for their prefix per request, at most
    # affinity_candidates + load_candidates whatever the fleet size. Affinity:
    # the rendezvous owners of the prompt's block ladder, where its prefix is
    # likely cached; load: the least loaded other pods by their pushed reports.
    affinity_candidates: int = 2
    load_candidates: int = 2
    # bounded: score added to the affinity candidates, so a prefix no pod
    # holds yet goes to its owner unless the owner carries that much more load
    # (0.1: about 1.6 more waiting requests, or 16 more running). Without it a
    # load report one request stale sends a new prefix to a load candidate,
    # which the prompt's next request does not ask: a miss.
    affinity_bonus: float = 0.1
    # How the scored pods' prefix matches are learned (PREFIX_MATCH_SOURCES):
    # "query" asks each scored pod per request, exact as of that instant;
    # "pushed" reads the caches the pods push with their load reports, up to
    # one load_interval_ms old, at no call per request. Pods without pushed
    # keys (an older engine) match nothing under "pushed".
    prefix_match: str = "query"
    # bounded with prefix_match "pushed": also score this many of the least
    # loaded pods holding the prompt's longest cached prefix (found in the
    # pushed index without a pass over the fleet), wherever the ring placed it.
    holder_candidates: int = 2
    # prefix_match "pushed": the most block keys believed of one pod, whatever
    # KV pool its reports claim (each costs the gateway about 140 bytes). The
    # default, 1M blocks of 16 tokens, is 16M cached tokens: past any one pod.
    max_pushed_blocks_per_pod: int = 1 << 20


KV_CHANNELS = ("redis", "direct")


@dataclass(frozen=True)
class DisaggregationConfig:
    # Prefill on a prefill pod only when at least this many prompt tokens are not cached.
    min_uncached_tokens: int = 256
    # How a prompt's KV goes from the prefill pod to the decode pod: "direct" (the
    # prefill pod pushes it to the decode pod the gateway picked, which must run with
    # --kv-inbox-bytes; Redis when the push fails) or "redis" (always through Redis).
    kv_channel: str = "redis"


@dataclass(frozen=True)
class PriorityClassConfig:
    name: str
    priority: int
    weight: float = 1.0
    sheddable: bool = False


@dataclass(frozen=True)
class InternalConfig:
    """How the gateway authenticates itself to engine pods."""

    # A file holding the deployment's internal secret (a mounted Secret).
    # None: TESSERA_INTERNAL_SECRET_FILE, else TESSERA_INTERNAL_SECRET.
    # The gateway refuses to start without one.
    secret_file: str | None = None
    # Mutual TLS to the pods (ca_file, cert_file, key_file, server_name);
    # None: plaintext, the bearer token alone authenticates.
    tls: InternalTLS | None = None


# The gateway reads the Batch API's Redis URL from here when the config has no
# batch.redis_url (the operator sets it from a Secret: a ConfigMap, like argv, is
# no place for a password), as the engines read TESSERA_KV_REDIS_URL.
BATCH_REDIS_URL_ENV = "TESSERA_BATCH_REDIS_URL"


@dataclass(frozen=True)
class BatchConfig:
    """The OpenAI Batch API (/v1/files, /v1/batches: gateway/batch/, docs/batch.md)."""

    directory: str | None = None
    """Where files and batches are kept without Redis (one gateway replica): a
    directory the gateway may write, surviving its restarts."""
    redis_url: str | None = field(default=None, repr=False)
    """Where files and batches are kept when several gateway replicas share
    them (redis://, rediss:// or unix://); takes precedence over `directory`.
    Absent here, and no `directory` either: the environment variable
    TESSERA_BATCH_REDIS_URL (BATCH_REDIS_URL_ENV), where a URL holding a
    password belongs. Never shown."""
    key_prefix: str = "tessera:batch:"
    """Prefix of every Redis key the Batch API writes."""
    redis_ca_file: str | None = None
    """rediss:// only: the CA bundle that signs the Redis server's certificate
    (absent: the system's CAs)."""
    redis_cert_file: str | None = None
    """rediss:// only: the client certificate (PEM), for a Redis that demands one."""
    redis_key_file: str | None = None
    """rediss:// only: the client certificate's private key (PEM)."""
    priority_class: str | None = None
    """The priority class batch lines run at. None: the sheddable class of
    lowest priority (the largest `priority`), or the lowest one if none sheds."""
    max_concurrency: int = 8
    """Lines of batches this gateway has in flight at most, all batches together."""
    max_file_bytes: int = 64 << 20
    """Bytes of one uploaded file at most (a larger one is refused, 400)."""
    max_lines_per_file: int = 50_000
    """Requests (lines) in one batch input file at most."""
    max_files_per_tenant: int = 1000
    """Files one tenant may keep (uploads and batch outputs together)."""
    max_batches_per_tenant: int = 1000
    """Batches one tenant may keep, whatever their status."""
    retention_s: float = 30 * 86400
    """Seconds a finished batch and its output and error files are kept after
    it ended (30 days); then they are removed (gateway/batch/retention.py)."""
    lease_s: float = 30.0
    """Seconds a runner's claim on a batch lasts unless renewed (renewed every
    third of it): a replica that dies holds its batches this long at most."""
    poll_interval_s: float = 1.0
    """Seconds between the runner's looks for batches to run."""
    retry_interval_s: float = 1.0
    """Seconds before a line the gateway shed (429/503) is tried again."""


@dataclass(frozen=True)
class GatewayConfig:
    model: ModelConfig
    server: ServerConfig = ServerConfig()
    pods: PodsConfig = PodsConfig()
    tenants_file: str | None = None
    # None: the built-in classes (gateway/priority.py).
    priority_classes: tuple[PriorityClassConfig, ...] | None = None
    default_priority_class: str | None = None
    admission: AdmissionConfig = AdmissionConfig()
    router: RouterConfig = RouterConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    internal: InternalConfig = InternalConfig()
    # None: the Batch API is off (its routes answer 404).
    batch: BatchConfig | None = None

    def __post_init__(self) -> None:
        _check(self.model.block_size > 0, "model.block_size must be > 0")
        _check(self.model.max_model_len is None or self.model.max_model_len > 0, "model.max_model_len must be > 0")
        _check_loras(self.model)
        _check_tool_call_parser(self.model)
        sources = [bool(self.pods.static), self.pods.kubernetes is not None, self.pods.file is not None]
        _check(sum(sources) == 1, "pods: give one of a static list, kubernetes discovery or a file")
        if self.pods.file is not None:
            _check(self.pods.file.poll_interval_s > 0, "pods.file.poll_interval_s must be > 0")
        for pod in self.pods.static:
            _check(pod.role in POD_ROLES, f"pods.static: role {pod.role!r} is not one of {POD_ROLES}")
            _check(":" in pod.address, f"pods.static: address {pod.address!r} is not host:port")
        if self.pods.kubernetes is not None:
            for role in self.pods.kubernetes.services:
                _check(role in POD_ROLES, f"pods.kubernetes.services: role {role!r} is not one of {POD_ROLES}")
        a = self.admission
        _check(a.max_waiting_per_pod >= 1, "admission.max_waiting_per_pod must be >= 1")
        _check(0 < a.max_kv_usage <= 1, "admission.max_kv_usage must be in (0, 1]")
        _check(a.max_queue_len >= 0, "admission.max_queue_len must be >= 0")
        _check(a.queue_timeout_s > 0, "admission.queue_timeout_s must be > 0")
        _check(self.router.policy in ROUTER_POLICIES,
               f"router.policy: {self.router.policy!r} is not one of {ROUTER_POLICIES}")
        w = self.router.weights
        weights = (w.prefix, w.prefill_backlog, w.waiting, w.running, w.kv_usage, w.lora_resident)
        _check(min(weights) >= 0, "router.weights must be >= 0")
        _check(self.router.running_norm >= 1, "router.running_norm must be >= 1")
        _check(self.router.load_interval_ms >= 10, "router.load_interval_ms must be >= 10")
        # A report may come one interval late without the pod being stalled.
        _check(self.router.load_timeout_s >= 2 * self.router.load_interval_ms / 1000,
               "router.load_timeout_s must be >= 2 x router.load_interval_ms")
        _check(self.router.stream_idle_timeout_s > 0, "router.stream_idle_timeout_s must be > 0")
        _check(self.router.reprobe_interval_s > 0, "router.reprobe_interval_s must be > 0")
        _check(0 <= self.router.affinity_candidates <= MAX_AFFINITY_CANDIDATES,
               f"router.affinity_candidates must be in [0, {MAX_AFFINITY_CANDIDATES}]")
        _check(self.router.load_candidates >= 0, "router.load_candidates must be >= 0")
        _check(self.router.affinity_bonus >= 0, "router.affinity_bonus must be >= 0")
        _check(self.router.prefix_match in PREFIX_MATCH_SOURCES,
               f"router.prefix_match: {self.router.prefix_match!r} is not one of {PREFIX_MATCH_SOURCES}")
        _check(0 <= self.router.holder_candidates <= MAX_AFFINITY_CANDIDATES,
               f"router.holder_candidates must be in [0, {MAX_AFFINITY_CANDIDATES}]")
        _check(self.router.max_pushed_blocks_per_pod >= 1, "router.max_pushed_blocks_per_pod must be >= 1")
        _check(self.router.affinity_candidates + self.router.load_candidates >= 1,
               "router.affinity_candidates + router.load_candidates must be >= 1")
        _check(self.disaggregation.min_uncached_tokens >= 0, "disaggregation.min_uncached_tokens must be >= 0")
        channel = self.disaggregation.kv_channel
        _check(channel in KV_CHANNELS, f"disaggregation.kv_channel must be one of {', '.join(KV_CHANNELS)}, "
                                       f"got {channel!r}")
        _check(isinstance(self.internal, InternalConfig), "internal: expected a mapping (secret_file, tls)")
        if self.batch is not None:
            _check_batch(self.batch)


def _check_loras(model: ModelConfig) -> None:
    _check(model.lora_admin_timeout_s > 0, "model.lora_admin_timeout_s must be > 0")
    seen: set[str] = set()
    for i, lora in enumerate(model.loras):
        problem = lora_name_problem(lora.name, model.name)
        _check(problem is None, f"model.loras[{i}].name: {problem}")
        _check(lora.name not in seen, f"model.loras[{i}].name: {lora.name!r} is listed twice")
        seen.add(lora.name)


def _check_batch(batch: BatchConfig) -> None:
    _check(batch.directory is not None or batch.redis_url is not None,
           f"batch: give a directory or a redis_url (or set {BATCH_REDIS_URL_ENV}) to keep files and batches in")
    try:  # the KV store's checks: one home for what a Redis URL and a key prefix may be
        if batch.redis_url is not None:
            check_redis_url(batch.redis_url, "batch.redis_url")
        check_key_prefix(batch.key_prefix, "batch.key_prefix")
    except ValueError as e:
        raise GatewayConfigError(str(e)) from None
    _check_batch_tls(batch)
    for name in ("max_concurrency", "max_file_bytes", "max_lines_per_file", "max_files_per_tenant",
                 "max_batches_per_tenant"):
        _check(getattr(batch, name) >= 1, f"batch.{name} must be >= 1")
    for name in ("lease_s", "poll_interval_s", "retry_interval_s", "retention_s"):
        _check(getattr(batch, name) > 0, f"batch.{name} must be > 0")


def _check_batch_tls(batch: BatchConfig) -> None:
    """The TLS files, by the engines' rules for --kv-redis-*-file (kv_store/redis_tier.py)."""
    try:
        check_tls_files(batch.redis_url, batch.redis_ca_file, batch.redis_cert_file, batch.redis_key_file,
                        "batch.redis_", f"URL (batch.redis_url or {BATCH_REDIS_URL_ENV})")
    except ValueError as e:
        raise GatewayConfigError(str(e)) from None


def _batch_redis_url_from(data: dict, environ: Mapping[str, str]) -> dict:
    """`data` with batch.redis_url taken from BATCH_REDIS_URL_ENV when the config has a `batch`
    section without one (the engines' rule for --kv-redis-url: the config first, else the
    variable; empty counts as unset). Checked here, so the message names the variable."""
    batch = data.get("batch")
    url = environ.get(BATCH_REDIS_URL_ENV)
    if not isinstance(batch, dict) or batch.get("redis_url") is not None or not url:
        return data
    if batch.get("directory") is not None:  # the config chose its store: a stray variable never moves it
        return data
    try:
        check_redis_url(url, BATCH_REDIS_URL_ENV)
    except ValueError as e:  # its message never shows the URL's credentials
        raise GatewayConfigError(str(e)) from None
    return {**data, "batch": {**batch, "redis_url": url}}


def _check_tool_call_parser(model: ModelConfig) -> None:
    name = model.tool_call_parser
    _check(name is None or name in parser_names(),
           f"model.tool_call_parser: unknown tool-call parser {name!r}; known: {', '.join(parser_names())}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise GatewayConfigError(message)


def _build(cls, data: Any, where: str):
    """A dataclass from a mapping, recursively, rejecting unknown keys."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise GatewayConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise GatewayConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(fields[name].type, value, f"{where}.{name}" if where else name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise GatewayConfigError(f"{where or 'config'}: {e}") from None


_NESTED = {
    "ModelConfig": ModelConfig, "ServerConfig": ServerConfig, "PodsConfig": PodsConfig,
    "AdmissionConfig": AdmissionConfig, "RouterConfig": RouterConfig, "RouterWeights": RouterWeights,
    "DisaggregationConfig": DisaggregationConfig, "InternalConfig": InternalConfig, "InternalTLS": InternalTLS,
    "BatchConfig": BatchConfig,
    "KubernetesDiscovery": KubernetesDiscovery, "FileDiscovery": FileDiscovery,
}


def _convert(type_name: str, value: Any, where: str) -> Any:
    base = type_name.split(" |")[0].strip()
    if value is None:
        return None
    if base in _NESTED:
        return _build(_NESTED[base], value, where)
    if base == "tuple[StaticPod, ...]":
        return tuple(_build(StaticPod, item, f"{where}[{i}]") for i, item in enumerate(_as_list(value, where)))
    if base == "tuple[LoRAConfig, ...]":
        return tuple(_build(LoRAConfig, item, f"{where}[{i}]") for i, item in enumerate(_as_list(value, where)))
    if base == "tuple[PriorityClassConfig, ...]":
        return tuple(_build(PriorityClassConfig, item, f"{where}[{i}]")
                     for i, item in enumerate(_as_list(value, where)))
    if base == "dict[str, str]":
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise GatewayConfigError(f"{where}: expected a mapping of names to names, got {value!r}")
        return dict(value)
    return _scalar(base, value, where)


def _as_list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise GatewayConfigError(f"{where}: expected a list")
    return value


def _scalar(base: str, value: Any, where: str) -> Any:
    expected = {"int": int, "float": (int, float), "str": str, "bool": bool}.get(base)
    if expected is None:
        return value
    if isinstance(value, bool) and base != "bool" or not isinstance(value, expected):
        raise GatewayConfigError(f"{where}: expected {base}, got {value!r}")
    return float(value) if base == "float" else value


def gateway_config_from_dict(data: dict, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """`environ`: where BATCH_REDIS_URL_ENV is looked up (None: nowhere, the mapping alone)."""
    if not isinstance(data, dict) or "model" not in data:
        raise GatewayConfigError("config: a mapping with at least `model` and `pods` is required")
    return _build(GatewayConfig, _batch_redis_url_from(data, environ or {}), "")


def load_gateway_config(path: str | Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """The config file at `path`, with what it leaves to the environment (`environ`, None: this
    process's): the Batch API's Redis URL (BATCH_REDIS_URL_ENV)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise GatewayConfigError(f"config: cannot read {path}: {e}") from None
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise GatewayConfigError(f"config: {path} is not valid YAML/JSON: {e}") from None
    return gateway_config_from_dict(data, os.environ if environ is None else environ)
