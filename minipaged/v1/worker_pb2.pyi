from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("address", "model_name", "model_fingerprint", "num_layers", "layer_start", "layer_end", "hidden_size", "vocab_size", "num_attention_heads", "num_kv_heads", "head_dim", "dtype", "device", "max_position_embeddings", "eos_token_ids", "kv_cache_bytes", "fixed_num_blocks", "cache_epoch", "num_blocks", "block_size", "backend", "dtype_bytes", "replica_group", "simulate", "weight_bytes", "data_port", "kv_tier_bytes", "role", "host_link_bytes_per_s", "peak_flops")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIXED_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUP_FIELD_NUMBER: _ClassVar[int]
    SIMULATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HOST_LINK_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    address: str
    model_name: str
    model_fingerprint: str
    num_layers: int
    layer_start: int
    layer_end: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    max_position_embeddings: int
    eos_token_ids: bytes
    kv_cache_bytes: int
    fixed_num_blocks: int
    cache_epoch: int
    num_blocks: int
    block_size: int
    backend: str
    dtype_bytes: int
    replica_group: str
    simulate: str
    weight_bytes: int
    data_port: int
    kv_tier_bytes: int
    role: str
    host_link_bytes_per_s: float
    peak_flops: float
    def __init__(self, address: _Optional[str] = ..., model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_position_embeddings: _Optional[int] = ..., eos_token_ids: _Optional[bytes] = ..., kv_cache_bytes: _Optional[int] = ..., fixed_num_blocks: _Optional[int] = ..., cache_epoch: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., backend: _Optional[str] = ..., dtype_bytes: _Optional[int] = ..., replica_group: _Optional[str] = ..., simulate: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., data_port: _Optional[int] = ..., kv_tier_bytes: _Optional[int] = ..., role: _Optional[str] = ..., host_link_bytes_per_s: _Optional[float] = ..., peak_flops: _Optional[float] = ...) -> None: ...

class InitCacheRequest(_message.Message):
    __slots__ = ("num_blocks", "block_size", "next_stage_address", "next_stage_token", "cache_epoch", "next_stage_data_address", "first_stage_address", "first_stage_data_address", "tier_blocks")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEXT_STAGE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_STAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_STAGE_DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STAGE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STAGE_DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    next_stage_address: str
    next_stage_token: str
    cache_epoch: int
    next_stage_data_address: str
    first_stage_address: str
    first_stage_data_address: str
    tier_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., next_stage_address: _Optional[str] = ..., next_stage_token: _Optional[str] = ..., cache_epoch: _Optional[int] = ..., next_stage_data_address: _Optional[str] = ..., first_stage_address: _Optional[str] = ..., first_stage_data_address: _Optional[str] = ..., tier_blocks: _Optional[int] = ...) -> None: ...

class InitCacheReply(_message.Message):
    __slots__ = ("cache_epoch", "num_blocks", "block_size")
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    cache_epoch: int
    num_blocks: int
    block_size: int
    def __init__(self, cache_epoch: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "cache_epoch", "sequence_ids", "input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "max_blocks_per_seq", "do_sample", "temperature", "top_p", "top_k", "seeds", "sample_offsets", "return_logprobs", "hidden_states", "hidden_dtype", "return_logits", "delta_tables", "table_base", "new_block_counts", "new_blocks", "release_sequence_ids", "copy_src", "copy_dst", "min_tokens_suppress", "suppress_counts", "suppress_ids", "repetition_penalty", "presence_penalty", "frequency_penalty", "penalty_counts", "penalty_prompt_lens", "penalty_tokens", "top_logprobs", "first_gets_tokens", "upstream_timings", "grammar_rows", "grammar_bitmask", "prompt_logprob_rows", "prompt_logprob_targets", "prompt_top_logprobs", "tier_save_blocks", "tier_save_slots", "tier_load_slots", "tier_load_blocks", "kv_sources", "kv_pull_src_blocks", "kv_pull_dst_blocks", "min_p")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    QUERY_START_LOC_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_SEQ_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    DELTA_TABLES_FIELD_NUMBER: _ClassVar[int]
    TABLE_BASE_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    COPY_SRC_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_SUPPRESS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_IDS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PENALTY_PROMPT_LENS_FIELD_NUMBER: _ClassVar[int]
    PENALTY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FIRST_GETS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ROWS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BITMASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_TARGETS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIER_SAVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_SAVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCES_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_DST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    cache_epoch: int
    sequence_ids: bytes
    input_ids: bytes
    positions: bytes
    slot_mapping: bytes
    query_start_loc: bytes
    seq_lens: bytes
    block_tables: bytes
    max_blocks_per_seq: int
    do_sample: bytes
    temperature: bytes
    top_p: bytes
    top_k: bytes
    seeds: bytes
    sample_offsets: bytes
    return_logprobs: bool
    hidden_states: bytes
    hidden_dtype: str
    return_logits: bool
    delta_tables: bool
    table_base: bytes
    new_block_counts: bytes
    new_blocks: bytes
    release_sequence_ids: bytes
    copy_src: bytes
    copy_dst: bytes
    min_tokens_suppress: bytes
    suppress_counts: bytes
    suppress_ids: bytes
    repetition_penalty: bytes
    presence_penalty: bytes
    frequency_penalty: bytes
    penalty_counts: bytes
    penalty_prompt_lens: bytes
    penalty_tokens: bytes
    top_logprobs: int
    first_gets_tokens: bool
    upstream_timings: _containers.RepeatedCompositeFieldContainer[StageTiming]
    grammar_rows: bytes
    grammar_bitmask: bytes
    prompt_logprob_rows: bytes
    prompt_logprob_targets: bytes
    prompt_top_logprobs: int
    tier_save_blocks: bytes
    tier_save_slots: bytes
    tier_load_slots: bytes
    tier_load_blocks: bytes
    kv_sources: _containers.RepeatedCompositeFieldContainer[KvSource]
    kv_pull_src_blocks: bytes
    kv_pull_dst_blocks: bytes
    min_p: bytes
    def __init__(self, step_id: _Optional[int] = ..., cache_epoch: _Optional[int] = ..., sequence_ids: _Optional[bytes] = ..., input_ids: _Optional[bytes] = ..., positions: _Optional[bytes] = ..., slot_mapping: _Optional[bytes] = ..., query_start_loc: _Optional[bytes] = ..., seq_lens: _Optional[bytes] = ..., block_tables: _Optional[bytes] = ..., max_blocks_per_seq: _Optional[int] = ..., do_sample: _Optional[bytes] = ..., temperature: _Optional[bytes] = ..., top_p: _Optional[bytes] = ..., top_k: _Optional[bytes] = ..., seeds: _Optional[bytes] = ..., sample_offsets: _Optional[bytes] = ..., return_logprobs: _Optional[bool] = ..., hidden_states: _Optional[bytes] = ..., hidden_dtype: _Optional[str] = ..., return_logits: _Optional[bool] = ..., delta_tables: _Optional[bool] = ..., table_base: _Optional[bytes] = ..., new_block_counts: _Optional[bytes] = ..., new_blocks: _Optional[bytes] = ..., release_sequence_ids: _Optional[bytes] = ..., copy_src: _Optional[bytes] = ..., copy_dst: _Optional[bytes] = ..., min_tokens_suppress: _Optional[bytes] = ..., suppress_counts: _Optional[bytes] = ..., suppress_ids: _Optional[bytes] = ..., repetition_penalty: _Optional[bytes] = ..., presence_penalty: _Optional[bytes] = ..., frequency_penalty: _Optional[bytes] = ..., penalty_counts: _Optional[bytes] = ..., penalty_prompt_lens: _Optional[bytes] = ..., penalty_tokens: _Optional[bytes] = ..., top_logprobs: _Optional[int] = ..., first_gets_tokens: _Optional[bool] = ..., upstream_timings: _Optional[_Iterable[_Union[StageTiming, _Mapping]]] = ..., grammar_rows: _Optional[bytes] = ..., grammar_bitmask: _Optional[bytes] = ..., prompt_logprob_rows: _Optional[bytes] = ..., prompt_logprob_targets: _Optional[bytes] = ..., prompt_top_logprobs: _Optional[int] = ..., tier_save_blocks: _Optional[bytes] = ..., tier_save_slots: _Optional[bytes] = ..., tier_load_slots: _Optional[bytes] = ..., tier_load_blocks: _Optional[bytes] = ..., kv_sources: _Optional[_Iterable[_Union[KvSource, _Mapping]]] = ..., kv_pull_src_blocks: _Optional[bytes] = ..., kv_pull_dst_blocks: _Optional[bytes] = ..., min_p: _Optional[bytes] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("layer_start", "layer_end", "data_address", "cache_epoch")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    data_address: str
    cache_epoch: int
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., data_address: _Optional[str] = ..., cache_epoch: _Optional[int] = ...) -> None: ...

class SampledTokens(_message.Message):
    __slots__ = ("step_id", "cache_epoch", "sequence_ids", "token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    cache_epoch: int
    sequence_ids: bytes
    token_ids: bytes
    def __init__(self, step_id: _Optional[int] = ..., cache_epoch: _Optional[int] = ..., sequence_ids: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class SampledTokensReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepResultsRequest(_message.Message):
    __slots__ = ("cache_epoch",)
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    cache_epoch: int
    def __init__(self, cache_epoch: _Optional[int] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("layer_start", "layer_end", "compute_ms")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    compute_ms: float
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., compute_ms: _Optional[float] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("step_id", "cache_epoch", "sampled_token_ids", "logprobs", "timings", "logits", "error_code", "error", "top_logprob_ids", "top_logprobs", "prompt_logprobs", "prompt_top_logprob_ids", "prompt_top_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROB_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    cache_epoch: int
    sampled_token_ids: bytes
    logprobs: bytes
    timings: _containers.RepeatedCompositeFieldContainer[StageTiming]
    logits: bytes
    error_code: int
    error: str
    top_logprob_ids: bytes
    top_logprobs: bytes
    prompt_logprobs: bytes
    prompt_top_logprob_ids: bytes
    prompt_top_logprobs: bytes
    def __init__(self, step_id: _Optional[int] = ..., cache_epoch: _Optional[int] = ..., sampled_token_ids: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., timings: _Optional[_Iterable[_Union[StageTiming, _Mapping]]] = ..., logits: _Optional[bytes] = ..., error_code: _Optional[int] = ..., error: _Optional[str] = ..., top_logprob_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., prompt_logprobs: _Optional[bytes] = ..., prompt_top_logprob_ids: _Optional[bytes] = ..., prompt_top_logprobs: _Optional[bytes] = ...) -> None: ...

class WorkerHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerHealthReply(_message.Message):
    __slots__ = ("ready", "cache_epoch", "steps_served", "busy_ms")
    READY_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_SERVED_FIELD_NUMBER: _ClassVar[int]
    BUSY_MS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    cache_epoch: int
    steps_served: int
    busy_ms: float
    def __init__(self, ready: _Optional[bool] = ..., cache_epoch: _Optional[int] = ..., steps_served: _Optional[int] = ..., busy_ms: _Optional[float] = ...) -> None: ...
