from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "prompt_logprobs", "n", "min_p", "include_stop_str_in_output", "skip_special_tokens", "guide")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GUIDE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    prompt_logprobs: int
    n: int
    min_p: float
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    guide: Guide
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., min_p: _Optional[float] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., guide: _Optional[_Union[Guide, _Mapping]] = ...) -> None: ...

class Guide(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "token_ids", "chat", "sampling", "include_timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    include_timings: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., include_timings: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("prefill_queue_s", "prefill_s", "kv_transfer_s", "decode_queue_s", "ttft_s", "e2e_s", "kv_bytes", "prefill_cached_tokens", "decode_cached_tokens")
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill_queue_s: float
    prefill_s: float
    kv_transfer_s: float
    decode_queue_s: float
    ttft_s: float
    e2e_s: float
    kv_bytes: int
    prefill_cached_tokens: int
    decode_cached_tokens: int
    def __init__(self, prefill_queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., decode_queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., prefill_cached_tokens: _Optional[int] = ..., decode_cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timings", "logprobs", "prompt_logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "prompt", "chat", "add_special_tokens", "add_generation_prompt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    chat: ChatMessages
    add_special_tokens: bool
    add_generation_prompt: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "count", "max_model_len")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    count: int
    max_model_len: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model", "tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    def __init__(self, prompt: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ready", "prefill_workers", "decode_workers")
    READY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    prefill_workers: int
    decode_workers: int
    def __init__(self, ready: _Optional[bool] = ..., prefill_workers: _Optional[int] = ..., decode_workers: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("kv_events", "kv_events_epoch", "kv_events_seq")
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_SEQ_FIELD_NUMBER: _ClassVar[int]
    kv_events: bool
    kv_events_epoch: int
    kv_events_seq: int
    def __init__(self, kv_events: _Optional[bool] = ..., kv_events_epoch: _Optional[int] = ..., kv_events_seq: _Optional[int] = ...) -> None: ...

class KvCacheEvents(_message.Message):
    __slots__ = ("epoch", "seq", "full", "stored", "removed")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    seq: int
    full: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, epoch: _Optional[int] = ..., seq: _Optional[int] = ..., full: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "num_free_blocks", "num_total_blocks", "num_running", "num_waiting", "queued_prompt_tokens", "draining", "prefix_hit_tokens", "prefix_query_tokens", "num_preemptions", "num_leases", "frames_rejected", "kv_endpoint", "kv_transport", "num_transfers", "block_size", "cpu_kernels", "open_streams", "max_streams", "kv_events", "threads", "node_cores", "tensor_parallel")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CPU_KERNELS_FIELD_NUMBER: _ClassVar[int]
    OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    NODE_CORES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int
    draining: bool
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int
    num_leases: int
    frames_rejected: int
    kv_endpoint: str
    kv_transport: str
    num_transfers: int
    block_size: int
    cpu_kernels: str
    open_streams: int
    max_streams: int
    kv_events: KvCacheEvents
    threads: int
    node_cores: int
    tensor_parallel: TensorParallelRanks
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., draining: _Optional[bool] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_leases: _Optional[int] = ..., frames_rejected: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., kv_transport: _Optional[str] = ..., num_transfers: _Optional[int] = ..., block_size: _Optional[int] = ..., cpu_kernels: _Optional[str] = ..., open_streams: _Optional[int] = ..., max_streams: _Optional[int] = ..., kv_events: _Optional[_Union[KvCacheEvents, _Mapping]] = ..., threads: _Optional[int] = ..., node_cores: _Optional[int] = ..., tensor_parallel: _Optional[_Union[TensorParallelRanks, _Mapping]] = ...) -> None: ...

class TensorParallelRanks(_message.Message):
    __slots__ = ("size", "ranks")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankState]
    def __init__(self, size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankState, _Mapping]]] = ...) -> None: ...

class RankState(_message.Message):
    __slots__ = ("rank", "pid", "alive")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    alive: bool
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., alive: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "lease_seconds", "lease_id", "block_hashes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    lease_seconds: float
    lease_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., lease_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "block_ids", "block_size", "kv_endpoint", "kv_transport", "deadline_s", "cached_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    kv_endpoint: str
    kv_transport: str
    deadline_s: float
    cached_blocks: int
    def __init__(self, lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., kv_transport: _Optional[str] = ..., deadline_s: _Optional[float] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "prompt_token_ids", "output_token_ids", "sampling", "fork_token_ids", "fork_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FORK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    fork_token_ids: _containers.RepeatedScalarFieldContainer[int]
    fork_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., fork_token_ids: _Optional[_Iterable[int]] = ..., fork_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "decode_queue_s", "logprobs", "prompt_logprobs", "index", "cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    decode_queue_s: float
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    index: int
    cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., decode_queue_s: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class KvDestination(_message.Message):
    __slots__ = ("endpoint", "transport", "lease_id", "block_size", "num_blocks", "first_block")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    transport: str
    lease_id: str
    block_size: int
    num_blocks: int
    first_block: int
    def __init__(self, endpoint: _Optional[str] = ..., transport: _Optional[str] = ..., lease_id: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., first_block: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "destination")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    destination: KvDestination
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KvDestination, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "queue_s", "prefill_s", "cached_tokens", "logprobs", "prompt_logprobs", "fork_token_ids", "fork_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    queue_s: float
    prefill_s: float
    cached_tokens: int
    logprobs: TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    fork_token_ids: _containers.RepeatedScalarFieldContainer[int]
    fork_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, token_id: _Optional[int] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., fork_token_ids: _Optional[_Iterable[int]] = ..., fork_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("bytes", "frames", "exposed_s")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_S_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    frames: int
    exposed_s: float
    def __init__(self, bytes: _Optional[int] = ..., frames: _Optional[int] = ..., exposed_s: _Optional[float] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "transfer_done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_done: TransferDone
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ...) -> None: ...

class KvFrame(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    payload: bytes
    def __init__(self, header: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("frames_accepted", "frames_rejected", "errors")
    FRAMES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    frames_accepted: int
    frames_rejected: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, frames_accepted: _Optional[int] = ..., frames_rejected: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...
