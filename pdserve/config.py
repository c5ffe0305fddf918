"""The cluster config: what ``pdserve serve`` launches, validated at the edge (YAML -> pydantic).

Errors name the field the way the YAML spells it, e.g. ``pools.decode.replicas: must be >= 1``.
Inside the cluster the validated model travels as a plain dict and is rebuilt where needed.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decode_worker.launch import DecodeSettings
from engine.config import (
    ACTIVATIONS,
    DTYPES,
    KV_DTYPES,
    LOAD_FORMATS,
    PREFILL_GEMMS,
    WEIGHT_FORMATS,
    WEIGHT_GROUPS,
    check_device_name,
    check_int8_prefill,
)
from engine.errors import PdserveError
from engine.request import MAX_LOGPROBS
from engine.settings import EngineSettings
from engine.tensor_parallel import check_tensor_parallel
from grpc_plumbing.tracing import tracing_missing
from grpc_plumbing.worker_process import ServerSettings
from kv_transfer.lease import MAX_LEASE_TTL_S
from kv_transfer.transports import WORKER_TRANSPORTS, transport_missing
from pdserve.share_cores import ShareCoresSection, check_share_cores
from router.limits import RequestLimits
from router.settings import RouterSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "cluster_configs"
DEFAULT_CONFIG = CONFIG_DIR / "local.yaml"


# Every default below comes from the frozen settings of the process that uses it: one home each.
_ENGINE = EngineSettings()
_DECODE = DecodeSettings()
_ROUTER = RouterSettings(model_dir="")
_LIMITS = RequestLimits()
_SERVER = ServerSettings()


class ConfigError(PdserveError):
    """A cluster config that cannot be used; the message lists every bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolConfig(_Strict):
    """One pool of workers: its size, its bounds for the autoscaler, and what each actor asks
    Ray for. ``num_cpus`` is Ray's logical count (it may be fractional, or 0 to pack several
    actors on a small machine); ``threads`` is what torch really uses."""

    replicas: int = Field(1, ge=1)
    min: int = Field(1, ge=1)
    max: int = Field(4, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    threads: int = Field(
        1,
        ge=0,
        description="torch threads per rank: a worker of tensor_parallel_size k runs k x this "
        "(0: torch's default at TP=1, the node's cores / k for each of k ranks)",
    )
    resources: dict[str, float] = Field(default_factory=dict, description="Ray custom resources")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks per worker (engine/tp_ranks.py): under Ray one placement group per "
        "worker, a bundle of num_cpus, resources (and num_gpus) per rank, all on one node",
    )

    @model_validator(mode="after")
    def _bounds(self) -> PoolConfig:
        if self.tensor_parallel_size > 1 and self.num_gpus not in (0, 1):
            # Rank r runs on cuda:r of the devices its worker sees (engine/tp_ranks.py).
            raise ValueError(
                f"num_gpus {self.num_gpus} with tensor_parallel_size "
                f"{self.tensor_parallel_size}: each rank takes one whole GPU; give 1 (or 0)"
            )
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        if not self.min <= self.replicas <= self.max:
            raise ValueError(
                f"replicas ({self.replicas}) must be within min..max ({self.min}..{self.max})"
            )
        return self


class Pools(_Strict):
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()

    def __getitem__(self, role: str) -> PoolConfig:
        return getattr(self, role)


class RouterSection(_Strict):
    """See router.settings.RouterSettings for what each does."""

    prefill_policy: str = _ROUTER.prefill_policy
    decode_policy: str = _ROUTER.decode_policy
    max_inflight_requests: int = Field(_ROUTER.max_inflight_requests, ge=1)
    default_max_tokens: int = Field(_ROUTER.default_max_tokens, ge=1)
    local_prefill_max_tokens: int = Field(_ROUTER.local_prefill_max_tokens, ge=0)
    kv_local_tail_tokens: int = Field(_ROUTER.kv_local_tail_tokens, ge=0)
    concurrent_reserve_headroom: float = Field(_ROUTER.concurrent_reserve_headroom, ge=-1, le=1)
    # Liveness: past these a worker is taken as hung and the request migrates.
    first_token_timeout_s: float = Field(_ROUTER.first_token_timeout_s, gt=0)
    first_token_s_per_token: float = Field(_ROUTER.first_token_s_per_token, ge=0)
    token_timeout_s: float = Field(_ROUTER.token_timeout_s, gt=0)
    # The circuit breaker takes at most this share of a pool out of routing.
    max_ejection_percent: float = Field(_ROUTER.max_ejection_percent, ge=0, le=100)


class AutoscalerConfig(_Strict):
    """Each pool between its own min and max, from its own signal. A pool grows by one when its
    signal is over target and shrinks by one when the signal is under ``low_ratio`` x target;
    after any change it waits ``cooldown_s`` so it does not flap. With ``planner_profile`` both
    pools instead go to the split the planner finds for the window's traffic."""

    enabled: bool = False
    period_s: float = Field(5.0, gt=0)
    cooldown_s: float = Field(30.0, ge=0)
    window_s: float = Field(30.0, gt=0, description="how far back latency observations count")
    ttft_target_s: float = Field(1.0, gt=0)
    tpot_target_s: float = Field(0.1, gt=0)
    prefill_tokens_per_s: float = Field(2000.0, gt=0, description="one prefill worker's rate")
    kv_high: float = Field(0.85, gt=0, le=1)
    kv_low: float = Field(0.3, ge=0, le=1)
    low_ratio: float = Field(0.5, gt=0, lt=1)
    planner_profile: str | None = Field(
        None,
        description="a `pdserve profile` file: both pools' targets come from simulating the "
        "window's finished requests on every split the bounds allow (pdserve/planner/"
        "autoscale.py) instead of one signal per pool",
    )
    planner_headroom: float = Field(
        1.2, ge=1, description="the window's rate is planned times this"
    )
    planner_min_requests: int = Field(
        8, ge=1, description="fewer finished requests in the window: hold the pools as they are"
    )


class TlsSection(_Strict):
    """The client API's certificate (PEM paths); ``client_ca``: clients need a certificate
    signed by it (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None


class ClusterTlsSection(_Strict):
    """Mutual TLS inside the cluster (worker gRPC, KV over grpc/flight, router to workers):
    every process presents ``cert``/``key`` and trusts only peers signed by ``ca``."""

    cert: str
    key: str
    ca: str
    server_name: str | None = Field(None, description="the name the certificate was issued for")


class SecuritySection(_Strict):
    """See docs/SECURITY.md. Off loopback the router needs ``api_key`` unless
    ``allow_unauthenticated``; workers always get a cluster token (the controller makes one)."""

    tls: TlsSection | None = None
    cluster_tls: ClusterTlsSection | None = None
    allow_unauthenticated: bool = False
    open_metrics: bool = Field(False, description="/metrics without the API key")
    # torch_dist's data path has no authentication past its rendezvous: off loopback only when
    # the operator says no one but the cluster reaches that network.
    kv_private_network: bool = False


class LimitsSection(_Strict):
    """Per-request caps; each refusal is a 400 naming the limit by these names."""

    max_request_bytes: int = Field(_LIMITS.max_request_bytes, ge=1)
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    max_stop_strings: int = Field(_LIMITS.max_stop_strings, ge=1)
    max_stop_string_chars: int = Field(_LIMITS.max_stop_string_chars, ge=1)
    # Cost caps (router/limits.py says why each): entries of logit_bias and stop_token_ids,
    # sequences (n x prompts), output tokens asked for (n x prompts x max_tokens), logprobs.
    max_logit_bias: int = Field(_LIMITS.max_logit_bias, ge=0)
    max_stop_token_ids: int = Field(_LIMITS.max_stop_token_ids, ge=0)
    max_sequences: int = Field(_LIMITS.max_sequences, ge=1)
    max_total_tokens: int = Field(_LIMITS.max_total_tokens, ge=1)
    max_logprobs: int = Field(_LIMITS.max_logprobs, ge=0, le=MAX_LOGPROBS)
    max_lease_seconds: float = Field(MAX_LEASE_TTL_S, gt=0, allow_inf_nan=False)


class ClusterConfig(_Strict):
    model: str = _ENGINE.model
    model_name: str = _ROUTER.model_name
    pools: Pools = Pools()
    kv_transport: Literal[WORKER_TRANSPORTS] = _DECODE.kv_transport
    block_size: int = Field(_ENGINE.block_size, ge=1)
    num_blocks: int = Field(_ENGINE.num_blocks, ge=1)
    max_model_len: int = Field(_ENGINE.max_model_len, ge=2)
    max_num_batched_tokens: int = Field(_ENGINE.max_num_batched_tokens, ge=1)
    max_num_seqs: int = Field(_ENGINE.max_num_seqs, ge=1)
    prefill_chunk_size: int = Field(_ENGINE.prefill_chunk_size, ge=0)
    device: str = Field(
        _ENGINE.device,
        description="cpu, cuda[:N], or auto: cuda where the worker's actor has a GPU",
    )
    dtype: Literal[DTYPES] = _ENGINE.dtype  # the model's float dtype; auto: bf16 on CUDA
    weights: Literal[WEIGHT_FORMATS] = _ENGINE.weights  # quantized at load (kernels/quant.py)
    weight_group: Literal[WEIGHT_GROUPS] = _ENGINE.weight_group  # q4: weights per scale
    kv_dtype: Literal[KV_DTYPES] = _ENGINE.kv_dtype
    # prefill's many-row matmuls; int8: int8 / q4 weights' int8-activation kernel; auto: the
    # fastest of bf16 and int8 for quantized weights, where it measures faster than fp32
    prefill_gemm: Literal[PREFILL_GEMMS] = _ENGINE.prefill_gemm
    # int8 / q4 weights' decode rows on CPU: int8 (byte dot products) or fp32 (exact)
    activations: Literal[ACTIVATIONS] = _ENGINE.activations
    # dummy: random weights from the model folder's config.json alone (profiles, benchmarks)
    load_format: Literal[LOAD_FORMATS] = _ENGINE.load_format
    lease_ttl_s: float = Field(_DECODE.lease_ttl_s, gt=0, allow_inf_nan=False)
    # false: prefill sends a chunk's KV after its whole forward, not layer by layer as it is
    # computed (no overlap of transfer and compute; for measuring what the overlap saves)
    prefill_layerwise_kv: bool = True
    host: str | None = Field(None, description="bind address; null: each node's own IP")
    grpc_port: int = Field(50051, ge=0, le=65535)
    http_port: int | None = Field(8000, ge=0, le=65535)
    router: RouterSection = RouterSection()
    autoscaler: AutoscalerConfig = AutoscalerConfig()
    health_period_s: float = Field(1.0, gt=0)
    # A worker whose actor answers but whose gRPC server the router cannot reach for this long
    # is replaced, as a dead one is.
    unreachable_after_s: float = Field(10.0, gt=0)
    worker_start_timeout_s: float = Field(600.0, gt=0)
    drain_timeout_s: float = Field(120.0, gt=0)
    # A graceful stop (SIGTERM to `pdserve serve`, or to a worker process): no new requests
    # (HTTP 429 / gRPC UNAVAILABLE with retry-after, health NOT_SERVING), running streams get
    # this long to finish; those left then end with an error, and everything exits.
    drain_grace_s: float = Field(_SERVER.drain_grace_s, gt=0, allow_inf_nan=False)
    # The workers' watchdog: an engine step running longer than this turns the worker's health
    # NOT_SERVING and its Status UNAVAILABLE, so the router routes around it (and the Ray
    # controller replaces it after unreachable_after_s). Generous: a slow CPU's longest step is
    # seconds.
    step_stall_timeout_s: float = Field(_SERVER.stall_timeout_s, gt=0)
    api_key: str | None = None
    cluster_token: str | None = None  # null: the controller makes a random one per cluster
    # OpenTelemetry traces (OTLP/gRPC, host:port or http(s)://host:port), from the router and
    # every worker; null: off. Needs pip install 'pdserve[tracing]'.
    otlp_traces_endpoint: str | None = None
    security: SecuritySection = SecuritySection()
    limits: LimitsSection = LimitsSection()
    # Prefill worker i and decode worker i on one node lend each other its cores every step
    # (pdserve/share_cores.py).
    share_cores: ShareCoresSection = ShareCoresSection()

    @field_validator("kv_transport", mode="before")
    @classmethod
    def _nccl_is_torch_dist(cls, value):
        # torch_dist runs NCCL between GPUs (gloo on CPU); operators know it as "nccl".
        return "torch_dist" if value == "nccl" else value

    @field_validator("kv_transport")
    @classmethod
    def _transport_installed(cls, value: str) -> str:
        # nixl needs its optional package: refused here, before any worker starts.
        if why := transport_missing(value):
            raise ValueError(why)
        return value

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _tracing_installed(cls, value: str | None) -> str | None:
        # Refused here, before anything starts, rather than when the router starts.
        if value and (why := tracing_missing()):
            raise ValueError(why)
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        # Checked by name only: the machine reading the config may have no GPU.
        return check_device_name(value)

    @field_validator("model")
    @classmethod
    def _absolute_model_path(cls, value: str) -> str:
        # Actors run elsewhere (another cwd, another node): a relative path would not resolve.
        path = Path(value).expanduser()
        return str(path.resolve()) if value != "embedded" and path.exists() else value

    def with_overrides(self, **fields) -> ClusterConfig:
        return validate_config({**self.model_dump(), **fields})

    @model_validator(mode="after")
    def _int8_prefill_weights(self) -> ClusterConfig:
        check_int8_prefill(self.prefill_gemm, self.weights, self.activations)
        return self

    @model_validator(mode="after")
    def _shared_cores(self) -> ClusterConfig:
        check_share_cores(self)
        return self

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> ClusterConfig:
        check_pools_tensor_parallel(self)
        return self

    @model_validator(mode="after")
    def _lease_bounds(self) -> ClusterConfig:
        if self.lease_ttl_s > self.limits.max_lease_seconds:
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s}) must be <= limits.max_lease_seconds "
                f"({self.limits.max_lease_seconds})"
            )
        return self


# Transports that write straight into the decode worker's (rank 0's) cache, not frames of KV
# heads that each rank's slice can travel in (kv_transfer/frame.py).
ONE_SIDED_TRANSPORTS = ("nixl", "shm")


def check_pools_tensor_parallel(cfg: ClusterConfig) -> None:
    """Each pool's tensor_parallel_size against the model's heads, KV heads and MLP columns,
    where the model's config can be read here (engine.model_files.model_shape; elsewhere the
    worker refuses it as it loads); and no TP pool under share_cores, whose node groups pair
    one prefill with one decode actor."""
    sizes = {role: cfg.pools[role].tensor_parallel_size for role in ("prefill", "decode")}
    if max(sizes.values()) == 1:
        return
    if cfg.share_cores.enabled:
        raise ValueError(
            "share_cores pairs single-rank workers: give share_cores.enabled false or every "
            "pool's tensor_parallel_size 1"
        )
    if cfg.kv_transport in ONE_SIDED_TRANSPORTS:
        raise ValueError(
            f"kv_transport {cfg.kv_transport} writes into one cache, not each rank's KV heads: "
            "with a pool's tensor_parallel_size over 1 give grpc, flight or torch_dist"
        )
    from engine.model_files import model_shape  # numpy, for GGUF: only where TP is asked

    shape = model_shape(cfg.model)
    for role, size in sizes.items():
        if shape is not None and size > 1:
            try:
                check_tensor_parallel(shape, size)
            except ValueError as e:  # "tensor_parallel_size 2: must divide ..."
                raise ValueError(f"pools.{role}.{e}") from None


def with_cluster_token(cfg: ClusterConfig) -> ClusterConfig:
    """``cfg`` with a cluster token: its own, else a new random one (256 bits). The controller
    calls it once per cluster, so every worker and the router share one token."""
    if cfg.cluster_token:
        return cfg
    return cfg.model_copy(update={"cluster_token": secrets.token_urlsafe(32)})


# ---- loading ---------------------------------------------------------------------------------
_MESSAGES = {
    "greater_than_equal": lambda c: f"must be >= {c['ge']}",
    "greater_than": lambda c: f"must be > {c['gt']}",
    "less_than_equal": lambda c: f"must be <= {c['le']}",
    "less_than": lambda c: f"must be < {c['lt']}",
    "extra_forbidden": lambda c: "unknown field",
    "missing": lambda c: "required",
}


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        fmt = _MESSAGES.get(e["type"])
        msg = fmt(e.get("ctx", {})) if fmt else e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "\n".join(lines)


def validate_config(data: dict, source: str = "config") -> ClusterConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source} is invalid:\n{_format_errors(e)}") from None


def load_config(path: str | Path | None = None) -> ClusterConfig:
    """Read and validate a YAML cluster config; ``None`` is the embedded local default."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read cluster config {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    return validate_config(data, str(path))
