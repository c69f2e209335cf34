from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "constraint", "prompt_logprobs", "prompt_logprobs_start", "min_tokens", "logit_bias", "disable_speculation")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_START_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    constraint: Constraint
    prompt_logprobs: bool
    prompt_logprobs_start: int
    min_tokens: int
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    disable_speculation: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_logprobs_start: _Optional[int] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., disable_speculation: _Optional[bool] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "regex", "ebnf", "json_object", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    ebnf: str
    json_object: bool
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., json_object: _Optional[bool] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenizedRequest(_message.Message):
    __slots__ = ("rid", "input_ids", "sampling", "priority", "cache_salt", "eos_token_ids", "arrival_time", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    rid: str
    input_ids: bytes
    sampling: SamplingParams
    priority: int
    cache_salt: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    arrival_time: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, rid: _Optional[str] = ..., input_ids: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., arrival_time: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("rid", "reason")
    RID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rid: str
    reason: str
    def __init__(self, rid: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class FrontendToScheduler(_message.Message):
    __slots__ = ("generate", "abort")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    generate: TokenizedRequest
    abort: AbortRequest
    def __init__(self, generate: _Optional[_Union[TokenizedRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("rid", "token_ids", "logprobs", "finish_reason", "finish_message", "matched_stop_token", "prompt_tokens", "cached_tokens", "completion_tokens", "queue_time", "prefill_time", "decode_time", "error_code", "prompt_logprobs", "prompt_logprobs_start", "retry_after", "cached_host_tokens", "cached_storage_tokens")
    RID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FINISH_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_FIELD_NUMBER: _ClassVar[int]
    DECODE_TIME_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_START_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    CACHED_HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_STORAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rid: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    finish_message: str
    matched_stop_token: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_time: float
    prefill_time: float
    decode_time: float
    error_code: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs_start: int
    retry_after: float
    cached_host_tokens: int
    cached_storage_tokens: int
    def __init__(self, rid: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., finish_message: _Optional[str] = ..., matched_stop_token: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., queue_time: _Optional[float] = ..., prefill_time: _Optional[float] = ..., decode_time: _Optional[float] = ..., error_code: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs_start: _Optional[int] = ..., retry_after: _Optional[float] = ..., cached_host_tokens: _Optional[int] = ..., cached_storage_tokens: _Optional[int] = ...) -> None: ...

class SchedulerToFrontend(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[TokenDelta]
    def __init__(self, outputs: _Optional[_Iterable[_Union[TokenDelta, _Mapping]]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("req_slot", "input_ids", "prefix_len", "out_slots", "is_new", "prefix_slots", "sample", "sampling", "output_ids", "eos_token_ids", "rid", "use_last_sampled", "prompt_logprob_row", "prompt_logprob_targets", "prompt_top_logprobs", "draft_tokens")
    REQ_SLOT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    OUT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    IS_NEW_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RID_FIELD_NUMBER: _ClassVar[int]
    USE_LAST_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_ROW_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_TARGETS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_slot: int
    input_ids: bytes
    prefix_len: int
    out_slots: bytes
    is_new: bool
    prefix_slots: bytes
    sample: bool
    sampling: SamplingParams
    output_ids: bytes
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    rid: str
    use_last_sampled: bool
    prompt_logprob_row: int
    prompt_logprob_targets: bytes
    prompt_top_logprobs: int
    draft_tokens: bytes
    def __init__(self, req_slot: _Optional[int] = ..., input_ids: _Optional[bytes] = ..., prefix_len: _Optional[int] = ..., out_slots: _Optional[bytes] = ..., is_new: _Optional[bool] = ..., prefix_slots: _Optional[bytes] = ..., sample: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., output_ids: _Optional[bytes] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., rid: _Optional[str] = ..., use_last_sampled: _Optional[bool] = ..., prompt_logprob_row: _Optional[int] = ..., prompt_logprob_targets: _Optional[bytes] = ..., prompt_top_logprobs: _Optional[int] = ..., draft_tokens: _Optional[bytes] = ...) -> None: ...

class ForwardBatch(_message.Message):
    __slots__ = ("batch_id", "is_decode", "reqs", "trace_context", "trace_links", "grammars", "copies")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    IS_DECODE_FIELD_NUMBER: _ClassVar[int]
    REQS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TRACE_LINKS_FIELD_NUMBER: _ClassVar[int]
    GRAMMARS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    is_decode: bool
    reqs: _containers.RepeatedCompositeFieldContainer[ForwardRequest]
    trace_context: _containers.ScalarMap[str, str]
    trace_links: _containers.RepeatedScalarFieldContainer[str]
    grammars: _containers.RepeatedCompositeFieldContainer[GrammarCompile]
    copies: _containers.RepeatedCompositeFieldContainer[KVCopy]
    def __init__(self, batch_id: _Optional[int] = ..., is_decode: _Optional[bool] = ..., reqs: _Optional[_Iterable[_Union[ForwardRequest, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., trace_links: _Optional[_Iterable[str]] = ..., grammars: _Optional[_Iterable[_Union[GrammarCompile, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[KVCopy, _Mapping]]] = ...) -> None: ...

class KVCopy(_message.Message):
    __slots__ = ("direction", "src_slots", "dst_slots", "keys", "load_id")
    class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DIRECTION_UNSPECIFIED: _ClassVar[KVCopy.Direction]
        DIRECTION_DEVICE_TO_HOST: _ClassVar[KVCopy.Direction]
        DIRECTION_HOST_TO_DEVICE: _ClassVar[KVCopy.Direction]
        DIRECTION_DEVICE_TO_STORAGE: _ClassVar[KVCopy.Direction]
        DIRECTION_STORAGE_TO_HOST: _ClassVar[KVCopy.Direction]
        DIRECTION_STORAGE_CLEAR: _ClassVar[KVCopy.Direction]
    DIRECTION_UNSPECIFIED: KVCopy.Direction
    DIRECTION_DEVICE_TO_HOST: KVCopy.Direction
    DIRECTION_HOST_TO_DEVICE: KVCopy.Direction
    DIRECTION_DEVICE_TO_STORAGE: KVCopy.Direction
    DIRECTION_STORAGE_TO_HOST: KVCopy.Direction
    DIRECTION_STORAGE_CLEAR: KVCopy.Direction
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    SRC_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    direction: KVCopy.Direction
    src_slots: bytes
    dst_slots: bytes
    keys: bytes
    load_id: int
    def __init__(self, direction: _Optional[_Union[KVCopy.Direction, str]] = ..., src_slots: _Optional[bytes] = ..., dst_slots: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., load_id: _Optional[int] = ...) -> None: ...

class StorageLoad(_message.Message):
    __slots__ = ("load_id", "pages")
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    load_id: int
    pages: int
    def __init__(self, load_id: _Optional[int] = ..., pages: _Optional[int] = ...) -> None: ...

class GrammarCompile(_message.Message):
    __slots__ = ("rid", "constraint")
    RID_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    rid: str
    constraint: Constraint
    def __init__(self, rid: _Optional[str] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class GrammarStatus(_message.Message):
    __slots__ = ("rid", "error", "error_code")
    RID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    rid: str
    error: str
    error_code: str
    def __init__(self, rid: _Optional[str] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("token_id", "logprob", "grammar_terminated", "grammar_error", "prompt_logprobs", "grammar_dead_end", "extra_token_ids", "extra_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_TERMINATED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_DEAD_END_FIELD_NUMBER: _ClassVar[int]
    EXTRA_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: TokenLogprob
    grammar_terminated: bool
    grammar_error: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    grammar_dead_end: bool
    extra_token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., grammar_terminated: _Optional[bool] = ..., grammar_error: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., grammar_dead_end: _Optional[bool] = ..., extra_token_ids: _Optional[_Iterable[int]] = ..., extra_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ForwardResult(_message.Message):
    __slots__ = ("batch_id", "tokens", "forward_time", "cuda_graph", "error", "worker_instance", "grammars", "storage_loads")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TIME_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    GRAMMARS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_LOADS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    forward_time: float
    cuda_graph: bool
    error: str
    worker_instance: str
    grammars: _containers.RepeatedCompositeFieldContainer[GrammarStatus]
    storage_loads: _containers.RepeatedCompositeFieldContainer[StorageLoad]
    def __init__(self, batch_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., forward_time: _Optional[float] = ..., cuda_graph: _Optional[bool] = ..., error: _Optional[str] = ..., worker_instance: _Optional[str] = ..., grammars: _Optional[_Iterable[_Union[GrammarStatus, _Mapping]]] = ..., storage_loads: _Optional[_Iterable[_Union[StorageLoad, _Mapping]]] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_id", "architecture", "vocab_size", "max_model_len", "max_total_num_tokens", "max_running_requests", "device", "dtype", "attention_backend", "num_parameters", "num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "eos_token_ids", "instance_id", "host_total_num_tokens", "storage_page_tokens", "weights_fingerprint")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_TOTAL_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    max_total_num_tokens: int
    max_running_requests: int
    device: str
    dtype: str
    attention_backend: str
    num_parameters: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    instance_id: str
    host_total_num_tokens: int
    storage_page_tokens: int
    weights_fingerprint: str
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_total_num_tokens: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., attention_backend: _Optional[str] = ..., num_parameters: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_key_value_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., instance_id: _Optional[str] = ..., host_total_num_tokens: _Optional[int] = ..., storage_page_tokens: _Optional[int] = ..., weights_fingerprint: _Optional[str] = ...) -> None: ...

class SchedulerToWorker(_message.Message):
    __slots__ = ("forward", "info")
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    forward: ForwardBatch
    info: WorkerInfoRequest
    def __init__(self, forward: _Optional[_Union[ForwardBatch, _Mapping]] = ..., info: _Optional[_Union[WorkerInfoRequest, _Mapping]] = ...) -> None: ...

class WorkerToScheduler(_message.Message):
    __slots__ = ("result", "info")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    result: ForwardResult
    info: WorkerInfo
    def __init__(self, result: _Optional[_Union[ForwardResult, _Mapping]] = ..., info: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class CacheEvents(_message.Message):
    __slots__ = ("instance_id", "seq", "block_tokens", "seed", "cleared", "stored", "removed", "snapshot", "num_requests")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    seq: int
    block_tokens: int
    seed: bytes
    cleared: bool
    stored: bytes
    removed: bytes
    snapshot: bool
    num_requests: int
    def __init__(self, instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., block_tokens: _Optional[int] = ..., seed: _Optional[bytes] = ..., cleared: _Optional[bool] = ..., stored: _Optional[bytes] = ..., removed: _Optional[bytes] = ..., snapshot: _Optional[bool] = ..., num_requests: _Optional[int] = ...) -> None: ...

class CacheSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ("storage",)
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    storage: bool
    def __init__(self, storage: _Optional[bool] = ...) -> None: ...

class FlushReply(_message.Message):
    __slots__ = ("flushed", "message")
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    flushed: bool
    message: str
    def __init__(self, flushed: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("max_total_num_tokens", "available_tokens", "evictable_tokens", "protected_tokens", "used_tokens", "num_running_reqs", "num_queue_reqs", "page_size", "worker", "host_total_tokens", "host_used_tokens", "host_demoted_tokens", "host_loaded_tokens", "host_dropped_tokens", "storage_stored_tokens", "storage_loaded_tokens", "storage_missed_tokens", "storage_failed_loads", "cache_events_port")
    MAX_TOTAL_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUE_REQS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    HOST_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_DEMOTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_DROPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_MISSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FAILED_LOADS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_PORT_FIELD_NUMBER: _ClassVar[int]
    max_total_num_tokens: int
    available_tokens: int
    evictable_tokens: int
    protected_tokens: int
    used_tokens: int
    num_running_reqs: int
    num_queue_reqs: int
    page_size: int
    worker: WorkerInfo
    host_total_tokens: int
    host_used_tokens: int
    host_demoted_tokens: int
    host_loaded_tokens: int
    host_dropped_tokens: int
    storage_stored_tokens: int
    storage_loaded_tokens: int
    storage_missed_tokens: int
    storage_failed_loads: int
    cache_events_port: int
    def __init__(self, max_total_num_tokens: _Optional[int] = ..., available_tokens: _Optional[int] = ..., evictable_tokens: _Optional[int] = ..., protected_tokens: _Optional[int] = ..., used_tokens: _Optional[int] = ..., num_running_reqs: _Optional[int] = ..., num_queue_reqs: _Optional[int] = ..., page_size: _Optional[int] = ..., worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., host_total_tokens: _Optional[int] = ..., host_used_tokens: _Optional[int] = ..., host_demoted_tokens: _Optional[int] = ..., host_loaded_tokens: _Optional[int] = ..., host_dropped_tokens: _Optional[int] = ..., storage_stored_tokens: _Optional[int] = ..., storage_loaded_tokens: _Optional[int] = ..., storage_missed_tokens: _Optional[int] = ..., storage_failed_loads: _Optional[int] = ..., cache_events_port: _Optional[int] = ...) -> None: ...
