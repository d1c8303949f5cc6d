from minipaged.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "return_logprobs", "n", "best_of", "min_new_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "top_logprobs", "min_p", "include_stop_str_in_output", "json_schema", "regex", "choice", "json_object", "grammar_after_token_id", "beam_width", "length_penalty", "early_stopping", "prompt_logprobs", "final_only")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_AFTER_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: bytes
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: bytes
    ignore_eos: bool
    return_logprobs: bool
    n: int
    best_of: int
    min_new_tokens: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    top_logprobs: int
    min_p: float
    include_stop_str_in_output: bool
    json_schema: str
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    json_object: bool
    grammar_after_token_id: int
    beam_width: int
    length_penalty: float
    early_stopping: str
    prompt_logprobs: int
    final_only: bool
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[bytes] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[bytes] = ..., ignore_eos: _Optional[bool] = ..., return_logprobs: _Optional[bool] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., top_logprobs: _Optional[int] = ..., min_p: _Optional[float] = ..., include_stop_str_in_output: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., json_object: _Optional[bool] = ..., grammar_after_token_id: _Optional[int] = ..., beam_width: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ..., final_only: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "preemptions")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    preemptions: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "logprobs", "index", "top_logprob_ids", "top_logprobs", "cumulative_logprob", "beam_score", "prompt_logprobs", "prompt_top_logprob_ids", "prompt_top_logprobs", "decode_seconds", "stop_str", "stop_token_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BEAM_SCORE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    text: str
    finish_reason: str
    usage: Usage
    logprobs: bytes
    index: int
    top_logprob_ids: bytes
    top_logprobs: bytes
    cumulative_logprob: float
    beam_score: float
    prompt_logprobs: bytes
    prompt_top_logprob_ids: bytes
    prompt_top_logprobs: bytes
    decode_seconds: float
    stop_str: str
    stop_token_id: int
    def __init__(self, token_ids: _Optional[bytes] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[bytes] = ..., index: _Optional[int] = ..., top_logprob_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., cumulative_logprob: _Optional[float] = ..., beam_score: _Optional[float] = ..., prompt_logprobs: _Optional[bytes] = ..., prompt_top_logprob_ids: _Optional[bytes] = ..., prompt_top_logprobs: _Optional[bytes] = ..., decode_seconds: _Optional[float] = ..., stop_str: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class GenerationResult(_message.Message):
    __slots__ = ("index", "token_ids", "text", "finish_reason", "usage", "error", "logprobs", "choices", "top_logprob_ids", "top_logprobs", "choice", "cumulative_logprob", "beam_score", "prompt_logprobs", "prompt_top_logprob_ids", "prompt_top_logprobs", "stop_str", "stop_token_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BEAM_SCORE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: bytes
    text: str
    finish_reason: str
    usage: Usage
    error: str
    logprobs: bytes
    choices: _containers.RepeatedCompositeFieldContainer[GenerationResult]
    top_logprob_ids: bytes
    top_logprobs: bytes
    choice: int
    cumulative_logprob: float
    beam_score: float
    prompt_logprobs: bytes
    prompt_top_logprob_ids: bytes
    prompt_top_logprobs: bytes
    stop_str: str
    stop_token_id: int
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[str] = ..., logprobs: _Optional[bytes] = ..., choices: _Optional[_Iterable[_Union[GenerationResult, _Mapping]]] = ..., top_logprob_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., choice: _Optional[int] = ..., cumulative_logprob: _Optional[float] = ..., beam_score: _Optional[float] = ..., prompt_logprobs: _Optional[bytes] = ..., prompt_top_logprob_ids: _Optional[bytes] = ..., prompt_top_logprobs: _Optional[bytes] = ..., stop_str: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("requests", "job_id")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    job_id: str
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., job_id: _Optional[str] = ...) -> None: ...

class SubmitJobReply(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "state", "total", "completed", "results", "created")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    total: int
    completed: int
    results: _containers.RepeatedCompositeFieldContainer[GenerationResult]
    created: float
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., total: _Optional[int] = ..., completed: _Optional[int] = ..., results: _Optional[_Iterable[_Union[GenerationResult, _Mapping]]] = ..., created: _Optional[float] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit", "state")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    limit: int
    state: str
    def __init__(self, limit: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class JobList(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class JobProgress(_message.Message):
    __slots__ = ("job_id", "state", "total", "completed", "new_results")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    NEW_RESULTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    total: int
    completed: int
    new_results: _containers.RepeatedCompositeFieldContainer[GenerationResult]
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., total: _Optional[int] = ..., completed: _Optional[int] = ..., new_results: _Optional[_Iterable[_Union[GenerationResult, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("num_blocks", "block_size", "used_blocks", "free_blocks", "cached_blocks", "internal_fragmentation_tokens", "kv_utilization", "running", "waiting", "preemptions", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate", "invariants_ok", "steps", "generated_tokens", "prompt_tokens", "tokens_per_second", "metadata_ms_per_step", "num_workers", "ready", "cache_epoch", "live_sequences", "shared_blocks", "not_ready_reason", "chains", "num_chains", "standby_workers", "metadata_cpu_seconds", "model", "max_model_len", "model_fingerprint", "model_shape", "tier_blocks", "tier_used_blocks", "tier_queries", "tier_hits", "tier_saved_blocks", "tier_loaded_blocks", "tier_block_bytes", "kv_moves", "kv_moved_blocks", "kv_move_failures", "max_waiting", "block_api_blocks", "block_api_used_blocks")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INTERNAL_FRAGMENTATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    INVARIANTS_OK_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    METADATA_MS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NOT_READY_REASON_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHAINS_FIELD_NUMBER: _ClassVar[int]
    STANDBY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    METADATA_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_QUERIES_FIELD_NUMBER: _ClassVar[int]
    TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    TIER_SAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_MOVES_FIELD_NUMBER: _ClassVar[int]
    KV_MOVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_MOVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_API_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_API_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    internal_fragmentation_tokens: int
    kv_utilization: float
    running: int
    waiting: int
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    invariants_ok: bool
    steps: int
    generated_tokens: int
    prompt_tokens: int
    tokens_per_second: float
    metadata_ms_per_step: float
    num_workers: int
    ready: bool
    cache_epoch: int
    live_sequences: int
    shared_blocks: int
    not_ready_reason: str
    chains: _containers.RepeatedCompositeFieldContainer[ChainStats]
    num_chains: int
    standby_workers: int
    metadata_cpu_seconds: float
    model: str
    max_model_len: int
    model_fingerprint: str
    model_shape: str
    tier_blocks: int
    tier_used_blocks: int
    tier_queries: int
    tier_hits: int
    tier_saved_blocks: int
    tier_loaded_blocks: int
    tier_block_bytes: int
    kv_moves: int
    kv_moved_blocks: int
    kv_move_failures: int
    max_waiting: int
    block_api_blocks: int
    block_api_used_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., internal_fragmentation_tokens: _Optional[int] = ..., kv_utilization: _Optional[float] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., invariants_ok: _Optional[bool] = ..., steps: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., metadata_ms_per_step: _Optional[float] = ..., num_workers: _Optional[int] = ..., ready: _Optional[bool] = ..., cache_epoch: _Optional[int] = ..., live_sequences: _Optional[int] = ..., shared_blocks: _Optional[int] = ..., not_ready_reason: _Optional[str] = ..., chains: _Optional[_Iterable[_Union[ChainStats, _Mapping]]] = ..., num_chains: _Optional[int] = ..., standby_workers: _Optional[int] = ..., metadata_cpu_seconds: _Optional[float] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., model_shape: _Optional[str] = ..., tier_blocks: _Optional[int] = ..., tier_used_blocks: _Optional[int] = ..., tier_queries: _Optional[int] = ..., tier_hits: _Optional[int] = ..., tier_saved_blocks: _Optional[int] = ..., tier_loaded_blocks: _Optional[int] = ..., tier_block_bytes: _Optional[int] = ..., kv_moves: _Optional[int] = ..., kv_moved_blocks: _Optional[int] = ..., kv_move_failures: _Optional[int] = ..., max_waiting: _Optional[int] = ..., block_api_blocks: _Optional[int] = ..., block_api_used_blocks: _Optional[int] = ...) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("address", "layer_start", "layer_end", "busy_fraction", "step_ms")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    address: str
    layer_start: int
    layer_end: int
    busy_fraction: float
    step_ms: float
    def __init__(self, address: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., busy_fraction: _Optional[float] = ..., step_ms: _Optional[float] = ...) -> None: ...

class ChainStats(_message.Message):
    __slots__ = ("chain_id", "ready", "num_blocks", "used_blocks", "free_blocks", "cached_blocks", "shared_blocks", "running", "waiting", "prefix_cache_queries", "prefix_cache_hits", "steps", "steps_per_second", "tokens_per_second", "stages", "cache_epoch", "micro_batches", "group", "generated_tokens", "invariants_ok", "tier_blocks", "tier_used_blocks", "tier_hits", "tier_saved_blocks", "tier_loaded_blocks", "role", "kv_moves", "kv_moved_blocks", "kv_move_failures")
    CHAIN_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INVARIANTS_OK_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    TIER_SAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_MOVES_FIELD_NUMBER: _ClassVar[int]
    KV_MOVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_MOVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    chain_id: int
    ready: bool
    num_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    shared_blocks: int
    running: int
    waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    steps: int
    steps_per_second: float
    tokens_per_second: float
    stages: _containers.RepeatedCompositeFieldContainer[StageStats]
    cache_epoch: int
    micro_batches: int
    group: str
    generated_tokens: int
    invariants_ok: bool
    tier_blocks: int
    tier_used_blocks: int
    tier_hits: int
    tier_saved_blocks: int
    tier_loaded_blocks: int
    role: str
    kv_moves: int
    kv_moved_blocks: int
    kv_move_failures: int
    def __init__(self, chain_id: _Optional[int] = ..., ready: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., shared_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., steps: _Optional[int] = ..., steps_per_second: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., stages: _Optional[_Iterable[_Union[StageStats, _Mapping]]] = ..., cache_epoch: _Optional[int] = ..., micro_batches: _Optional[int] = ..., group: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., invariants_ok: _Optional[bool] = ..., tier_blocks: _Optional[int] = ..., tier_used_blocks: _Optional[int] = ..., tier_hits: _Optional[int] = ..., tier_saved_blocks: _Optional[int] = ..., tier_loaded_blocks: _Optional[int] = ..., role: _Optional[str] = ..., kv_moves: _Optional[int] = ..., kv_moved_blocks: _Optional[int] = ..., kv_move_failures: _Optional[int] = ...) -> None: ...

class PoolSnapshotRequest(_message.Message):
    __slots__ = ("max_blocks", "max_sequences")
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    max_blocks: int
    max_sequences: int
    def __init__(self, max_blocks: _Optional[int] = ..., max_sequences: _Optional[int] = ...) -> None: ...

class SequenceSnapshot(_message.Message):
    __slots__ = ("sequence_id", "state", "length", "num_blocks", "block_table", "num_cached_tokens", "label")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    state: str
    length: int
    num_blocks: int
    block_table: bytes
    num_cached_tokens: int
    label: str
    def __init__(self, sequence_id: _Optional[int] = ..., state: _Optional[str] = ..., length: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_table: _Optional[bytes] = ..., num_cached_tokens: _Optional[int] = ..., label: _Optional[str] = ...) -> None: ...

class ChainSnapshot(_message.Message):
    __slots__ = ("chain_id", "num_blocks", "block_size", "stride", "block_state", "ref_counts", "free_blocks", "owned_blocks", "shared_blocks", "cached_blocks", "sequences", "running", "waiting")
    CHAIN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STATE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OWNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    chain_id: int
    num_blocks: int
    block_size: int
    stride: int
    block_state: bytes
    ref_counts: bytes
    free_blocks: int
    owned_blocks: int
    shared_blocks: int
    cached_blocks: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceSnapshot]
    running: int
    waiting: int
    def __init__(self, chain_id: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., stride: _Optional[int] = ..., block_state: _Optional[bytes] = ..., ref_counts: _Optional[bytes] = ..., free_blocks: _Optional[int] = ..., owned_blocks: _Optional[int] = ..., shared_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceSnapshot, _Mapping]]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class PoolSnapshotReply(_message.Message):
    __slots__ = ("chains", "time")
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    chains: _containers.RepeatedCompositeFieldContainer[ChainSnapshot]
    time: float
    def __init__(self, chains: _Optional[_Iterable[_Union[ChainSnapshot, _Mapping]]] = ..., time: _Optional[float] = ...) -> None: ...

class CreateSequenceRequest(_message.Message):
    __slots__ = ("sequence_id", "prompt_token_ids", "num_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    prompt_token_ids: bytes
    num_tokens: int
    def __init__(self, sequence_id: _Optional[int] = ..., prompt_token_ids: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class SequenceReply(_message.Message):
    __slots__ = ("sequence_id", "sequence_length", "block_table", "slot_mapping", "num_cached_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    sequence_length: int
    block_table: bytes
    slot_mapping: bytes
    num_cached_tokens: int
    def __init__(self, sequence_id: _Optional[int] = ..., sequence_length: _Optional[int] = ..., block_table: _Optional[bytes] = ..., slot_mapping: _Optional[bytes] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class AppendTokensRequest(_message.Message):
    __slots__ = ("sequence_ids", "num_tokens", "token_ids")
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: bytes
    num_tokens: bytes
    token_ids: bytes
    def __init__(self, sequence_ids: _Optional[bytes] = ..., num_tokens: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class AppendTokensReply(_message.Message):
    __slots__ = ("slot_mapping",)
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    slot_mapping: bytes
    def __init__(self, slot_mapping: _Optional[bytes] = ...) -> None: ...

class ForkSequenceRequest(_message.Message):
    __slots__ = ("parent_id", "child_id")
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_ID_FIELD_NUMBER: _ClassVar[int]
    parent_id: int
    child_id: int
    def __init__(self, parent_id: _Optional[int] = ..., child_id: _Optional[int] = ...) -> None: ...

class ForkSequenceReply(_message.Message):
    __slots__ = ("copy_src", "copy_dst")
    COPY_SRC_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_FIELD_NUMBER: _ClassVar[int]
    copy_src: bytes
    copy_dst: bytes
    def __init__(self, copy_src: _Optional[bytes] = ..., copy_dst: _Optional[bytes] = ...) -> None: ...

class ReleaseSequenceRequest(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    def __init__(self, sequence_id: _Optional[int] = ...) -> None: ...

class ReleaseSequenceReply(_message.Message):
    __slots__ = ("freed_blocks",)
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    freed_blocks: int
    def __init__(self, freed_blocks: _Optional[int] = ...) -> None: ...

class GetBlockTablesRequest(_message.Message):
    __slots__ = ("sequence_ids",)
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: bytes
    def __init__(self, sequence_ids: _Optional[bytes] = ...) -> None: ...

class GetBlockTablesReply(_message.Message):
    __slots__ = ("block_tables", "max_blocks", "seq_lens")
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    block_tables: bytes
    max_blocks: int
    seq_lens: bytes
    def __init__(self, block_tables: _Optional[bytes] = ..., max_blocks: _Optional[int] = ..., seq_lens: _Optional[bytes] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _worker_pb2.WorkerInfo
    def __init__(self, info: _Optional[_Union[_worker_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterWorkerReply(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_ms", "lease_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_ms: int
    lease_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "cache_epoch", "steps_served")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_SERVED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    cache_epoch: int
    steps_served: int
    def __init__(self, worker_id: _Optional[str] = ..., cache_epoch: _Optional[int] = ..., steps_served: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "reason")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    known: bool
    reason: str
    def __init__(self, known: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class CancelPendingJobsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class CancelPendingJobsReply(_message.Message):
    __slots__ = ("jobs", "requests")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    jobs: int
    requests: int
    def __init__(self, jobs: _Optional[int] = ..., requests: _Optional[int] = ...) -> None: ...

class PurgeJobsRequest(_message.Message):
    __slots__ = ("older_than_s",)
    OLDER_THAN_S_FIELD_NUMBER: _ClassVar[int]
    older_than_s: float
    def __init__(self, older_than_s: _Optional[float] = ...) -> None: ...

class PurgeJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: int
    def __init__(self, jobs: _Optional[int] = ...) -> None: ...
