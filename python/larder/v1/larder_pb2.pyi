from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

API_VERSION_CURRENT: ApiVersion
API_VERSION_UNSPECIFIED: ApiVersion
DESCRIPTOR: _descriptor.FileDescriptor
OFFSETS: VariableLayout
PADDED: VariableLayout

class AddDatasetRequest(_message.Message):
    __slots__ = ["name", "replace", "table"]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    replace: bool
    table: str
    def __init__(self, name: _Optional[str] = ..., table: _Optional[str] = ..., replace: bool = ...) -> None: ...

class AddDatasetResponse(_message.Message):
    __slots__ = ["dataset"]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetInfo
    def __init__(self, dataset: _Optional[_Union[DatasetInfo, _Mapping]] = ...) -> None: ...

class BadSample(_message.Message):
    __slots__ = ["dataset", "error", "index"]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    error: str
    index: int
    def __init__(self, dataset: _Optional[str] = ..., index: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ["batch_index", "data", "fields", "labels", "num_batches", "order_version", "padding", "resume_sample", "sample_ids", "shape", "slot", "step", "stream_id"]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    ORDER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    RESUME_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    data: bytes
    fields: _containers.RepeatedCompositeFieldContainer[FieldBatch]
    labels: _containers.RepeatedScalarFieldContainer[int]
    num_batches: int
    order_version: int
    padding: int
    resume_sample: int
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    slot: int
    step: int
    stream_id: int
    def __init__(self, batch_index: _Optional[int] = ..., num_batches: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., labels: _Optional[_Iterable[int]] = ..., sample_ids: _Optional[_Iterable[int]] = ..., fields: _Optional[_Iterable[_Union[FieldBatch, _Mapping]]] = ..., slot: _Optional[int] = ..., step: _Optional[int] = ..., resume_sample: _Optional[int] = ..., padding: _Optional[int] = ..., stream_id: _Optional[int] = ..., order_version: _Optional[int] = ...) -> None: ...

class DaemonInfo(_message.Message):
    __slots__ = ["api_version", "kinds", "min_client_api_version", "version"]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    MIN_CLIENT_API_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    api_version: int
    kinds: _containers.RepeatedScalarFieldContainer[str]
    min_client_api_version: int
    version: str
    def __init__(self, version: _Optional[str] = ..., api_version: _Optional[int] = ..., min_client_api_version: _Optional[int] = ..., kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ["bad_samples", "fields", "has_labels", "has_train_pipeline", "kind", "name", "num_samples", "owner", "sample_bytes", "sample_shape", "source"]
    BAD_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    HAS_LABELS_FIELD_NUMBER: _ClassVar[int]
    HAS_TRAIN_PIPELINE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    bad_samples: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldInfo]
    has_labels: bool
    has_train_pipeline: bool
    kind: str
    name: str
    num_samples: int
    owner: str
    sample_bytes: int
    sample_shape: _containers.RepeatedScalarFieldContainer[int]
    source: str
    def __init__(self, name: _Optional[str] = ..., num_samples: _Optional[int] = ..., sample_shape: _Optional[_Iterable[int]] = ..., has_labels: bool = ..., source: _Optional[str] = ..., sample_bytes: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[FieldInfo, _Mapping]]] = ..., has_train_pipeline: bool = ..., bad_samples: _Optional[int] = ..., owner: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class DatasetStats(_message.Message):
    __slots__ = ["bad_samples", "dataset", "tiers"]
    BAD_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    bad_samples: int
    dataset: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    def __init__(self, dataset: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., bad_samples: _Optional[int] = ...) -> None: ...

class FieldBatch(_message.Message):
    __slots__ = ["data", "dtype", "lengths", "name", "offsets", "sample_shape", "shape", "slot_bytes", "slot_offset"]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    lengths: _containers.RepeatedScalarFieldContainer[int]
    name: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sample_shape: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    slot_bytes: int
    slot_offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., lengths: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., sample_shape: _Optional[_Iterable[int]] = ..., slot_offset: _Optional[int] = ..., slot_bytes: _Optional[int] = ...) -> None: ...

class FieldInfo(_message.Message):
    __slots__ = ["dtype", "name", "paired_with", "resample", "scale", "shape"]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PAIRED_WITH_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    name: str
    paired_with: str
    resample: str
    scale: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., paired_with: _Optional[str] = ..., scale: _Optional[int] = ..., resample: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class ListBadSamplesRequest(_message.Message):
    __slots__ = ["dataset"]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    def __init__(self, dataset: _Optional[str] = ...) -> None: ...

class ListBadSamplesResponse(_message.Message):
    __slots__ = ["samples"]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[BadSample]
    def __init__(self, samples: _Optional[_Iterable[_Union[BadSample, _Mapping]]] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ["datasets", "unavailable"]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    unavailable: _containers.RepeatedCompositeFieldContainer[UnavailableDataset]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ..., unavailable: _Optional[_Iterable[_Union[UnavailableDataset, _Mapping]]] = ...) -> None: ...

class ListStreamsRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class ListStreamsResponse(_message.Message):
    __slots__ = ["others", "pool_busy", "streams"]
    OTHERS_FIELD_NUMBER: _ClassVar[int]
    POOL_BUSY_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    others: int
    pool_busy: float
    streams: _containers.RepeatedCompositeFieldContainer[StreamInfo]
    def __init__(self, streams: _Optional[_Iterable[_Union[StreamInfo, _Mapping]]] = ..., others: _Optional[int] = ..., pool_busy: _Optional[float] = ...) -> None: ...

class RemoveDatasetRequest(_message.Message):
    __slots__ = ["name"]
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveDatasetResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class ReportInputRequest(_message.Message):
    __slots__ = ["batches", "job", "step_seconds", "stream_id", "wait_seconds", "window_step_seconds", "window_wait_seconds"]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    batches: int
    job: str
    step_seconds: float
    stream_id: int
    wait_seconds: float
    window_step_seconds: float
    window_wait_seconds: float
    def __init__(self, stream_id: _Optional[int] = ..., job: _Optional[str] = ..., batches: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., window_wait_seconds: _Optional[float] = ..., window_step_seconds: _Optional[float] = ...) -> None: ...

class SourceKindRequest(_message.Message):
    __slots__ = ["path"]
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class SourceKindResponse(_message.Message):
    __slots__ = ["kind", "kinds", "reason"]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    kinds: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, kind: _Optional[str] = ..., reason: _Optional[str] = ..., kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ["accounted_bytes", "active_streams", "admissions_declined", "allocator_free_bytes", "anonymous_bytes", "anonymous_ceiling_bytes", "bad_samples", "batch_wait_bounds", "batch_wait_counts", "batch_wait_sum_seconds", "batches_served", "bytes_served", "client_stall_seconds", "coalesced_fetches", "datasets", "footprint_bytes", "footprint_limit_bytes", "hit_rate", "machine_available_bytes", "measured_expansion_factor", "memory_budget_bytes", "memory_bytes", "memory_configured_budget_bytes", "memory_entries", "memory_policy", "memory_policy_bytes", "memory_policy_seconds", "message_budget_bytes", "message_buffer_in_flight_bytes", "message_buffer_spare_bytes", "object_bytes", "object_gets", "planned_expansion_factor", "pool_busy", "pool_threads", "prefetched_raw_bytes", "prefetched_samples", "resident_bytes", "samples_served", "scratch_budget_bytes", "scratch_bytes", "scratch_corrupt_records", "scratch_paused", "shared_bytes", "shm_batches", "shm_budget_bytes", "shm_bytes", "shm_fallbacks", "shm_rings", "tiers", "uptime_seconds", "user_footprint_limit_bytes"]
    ACCOUNTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_DECLINED_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ANONYMOUS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ANONYMOUS_CEILING_BYTES_FIELD_NUMBER: _ClassVar[int]
    BAD_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SERVED_FIELD_NUMBER: _ClassVar[int]
    BATCH_WAIT_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_WAIT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_WAIT_SUM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COALESCED_FETCHES_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    MACHINE_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_EXPANSION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CONFIGURED_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_POLICY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_POLICY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_POLICY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BUFFER_IN_FLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BUFFER_SPARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECT_GETS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_EXPANSION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    POOL_BUSY_FIELD_NUMBER: _ClassVar[int]
    POOL_THREADS_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SERVED_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_CORRUPT_RECORDS_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_PAUSED_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SHM_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    SHM_RINGS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    USER_FOOTPRINT_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    accounted_bytes: int
    active_streams: int
    admissions_declined: int
    allocator_free_bytes: int
    anonymous_bytes: int
    anonymous_ceiling_bytes: int
    bad_samples: int
    batch_wait_bounds: _containers.RepeatedScalarFieldContainer[float]
    batch_wait_counts: _containers.RepeatedScalarFieldContainer[int]
    batch_wait_sum_seconds: float
    batches_served: int
    bytes_served: int
    client_stall_seconds: float
    coalesced_fetches: int
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetStats]
    footprint_bytes: int
    footprint_limit_bytes: int
    hit_rate: float
    machine_available_bytes: int
    measured_expansion_factor: float
    memory_budget_bytes: int
    memory_bytes: int
    memory_configured_budget_bytes: int
    memory_entries: int
    memory_policy: str
    memory_policy_bytes: int
    memory_policy_seconds: float
    message_budget_bytes: int
    message_buffer_in_flight_bytes: int
    message_buffer_spare_bytes: int
    object_bytes: int
    object_gets: int
    planned_expansion_factor: float
    pool_busy: float
    pool_threads: int
    prefetched_raw_bytes: int
    prefetched_samples: int
    resident_bytes: int
    samples_served: int
    scratch_budget_bytes: int
    scratch_bytes: int
    scratch_corrupt_records: int
    scratch_paused: str
    shared_bytes: int
    shm_batches: int
    shm_budget_bytes: int
    shm_bytes: int
    shm_fallbacks: int
    shm_rings: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    uptime_seconds: float
    user_footprint_limit_bytes: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., memory_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., memory_entries: _Optional[int] = ..., hit_rate: _Optional[float] = ..., client_stall_seconds: _Optional[float] = ..., batches_served: _Optional[int] = ..., samples_served: _Optional[int] = ..., bytes_served: _Optional[int] = ..., active_streams: _Optional[int] = ..., coalesced_fetches: _Optional[int] = ..., admissions_declined: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., machine_available_bytes: _Optional[int] = ..., measured_expansion_factor: _Optional[float] = ..., scratch_bytes: _Optional[int] = ..., scratch_budget_bytes: _Optional[int] = ..., scratch_corrupt_records: _Optional[int] = ..., scratch_paused: _Optional[str] = ..., planned_expansion_factor: _Optional[float] = ..., shm_rings: _Optional[int] = ..., shm_bytes: _Optional[int] = ..., shm_budget_bytes: _Optional[int] = ..., shm_batches: _Optional[int] = ..., shm_fallbacks: _Optional[int] = ..., bad_samples: _Optional[int] = ..., message_buffer_spare_bytes: _Optional[int] = ..., message_buffer_in_flight_bytes: _Optional[int] = ..., accounted_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., anonymous_bytes: _Optional[int] = ..., shared_bytes: _Optional[int] = ..., anonymous_ceiling_bytes: _Optional[int] = ..., allocator_free_bytes: _Optional[int] = ..., memory_policy: _Optional[str] = ..., memory_policy_bytes: _Optional[int] = ..., memory_policy_seconds: _Optional[float] = ..., batch_wait_bounds: _Optional[_Iterable[float]] = ..., batch_wait_counts: _Optional[_Iterable[int]] = ..., batch_wait_sum_seconds: _Optional[float] = ..., pool_busy: _Optional[float] = ..., pool_threads: _Optional[int] = ..., datasets: _Optional[_Iterable[_Union[DatasetStats, _Mapping]]] = ..., memory_configured_budget_bytes: _Optional[int] = ..., message_budget_bytes: _Optional[int] = ..., prefetched_samples: _Optional[int] = ..., prefetched_raw_bytes: _Optional[int] = ..., object_gets: _Optional[int] = ..., object_bytes: _Optional[int] = ..., footprint_bytes: _Optional[int] = ..., footprint_limit_bytes: _Optional[int] = ..., user_footprint_limit_bytes: _Optional[int] = ...) -> None: ...

class StreamBatchesRequest(_message.Message):
    __slots__ = ["augment_seed", "batch_size", "cohort_seed", "dataset", "drop_last", "epoch", "even_batches", "fields", "held_slots", "layout_version", "node", "nodes", "num_workers", "order_version", "partitions", "pipeline", "rank", "resumed_nodes", "resumed_sample", "seed", "sequential", "shm_ring", "start_batch", "start_sample", "start_step", "swap", "variable_layout", "window", "worker", "world_size"]
    AUGMENT_SEED_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    COHORT_SEED_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EVEN_BATCHES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    HELD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ORDER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESUMED_NODES_FIELD_NUMBER: _ClassVar[int]
    RESUMED_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SEQUENTIAL_FIELD_NUMBER: _ClassVar[int]
    SHM_RING_FIELD_NUMBER: _ClassVar[int]
    START_BATCH_FIELD_NUMBER: _ClassVar[int]
    START_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    SWAP_FIELD_NUMBER: _ClassVar[int]
    VARIABLE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    augment_seed: int
    batch_size: int
    cohort_seed: int
    dataset: str
    drop_last: bool
    epoch: int
    even_batches: bool
    fields: _containers.RepeatedScalarFieldContainer[str]
    held_slots: _containers.RepeatedScalarFieldContainer[int]
    layout_version: int
    node: int
    nodes: int
    num_workers: int
    order_version: int
    partitions: int
    pipeline: str
    rank: int
    resumed_nodes: int
    resumed_sample: int
    seed: int
    sequential: bool
    shm_ring: bytes
    start_batch: int
    start_sample: int
    start_step: int
    swap: float
    variable_layout: VariableLayout
    window: int
    worker: int
    world_size: int
    def __init__(self, dataset: _Optional[str] = ..., batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., start_batch: _Optional[int] = ..., sequential: bool = ..., drop_last: bool = ..., fields: _Optional[_Iterable[str]] = ..., variable_layout: _Optional[_Union[VariableLayout, str]] = ..., layout_version: _Optional[int] = ..., shm_ring: _Optional[bytes] = ..., held_slots: _Optional[_Iterable[int]] = ..., worker: _Optional[int] = ..., num_workers: _Optional[int] = ..., start_sample: _Optional[int] = ..., start_step: _Optional[int] = ..., even_batches: bool = ..., pipeline: _Optional[str] = ..., nodes: _Optional[int] = ..., node: _Optional[int] = ..., partitions: _Optional[int] = ..., swap: _Optional[float] = ..., resumed_nodes: _Optional[int] = ..., resumed_sample: _Optional[int] = ..., order_version: _Optional[int] = ..., augment_seed: _Optional[int] = ..., cohort_seed: _Optional[int] = ..., window: _Optional[int] = ...) -> None: ...

class StreamInfo(_message.Message):
    __slots__ = ["advice", "batches", "bytes_per_second", "cause", "compute_bound_below", "dataset", "epoch", "id", "input_bound_above", "job", "measured_by_client", "memory_samples", "num_batches", "open_seconds", "pid", "rank", "raw_samples", "ready_batches", "samples", "samples_per_second", "scratch_samples", "shm", "user", "verdict", "wait_ratio", "wait_seconds", "world_size"]
    ADVICE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_BOUND_BELOW_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_BOUND_ABOVE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    MEASURED_BY_CLIENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    OPEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RAW_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    READY_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    WAIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    advice: str
    batches: int
    bytes_per_second: float
    cause: str
    compute_bound_below: float
    dataset: str
    epoch: int
    id: int
    input_bound_above: float
    job: str
    measured_by_client: bool
    memory_samples: int
    num_batches: int
    open_seconds: float
    pid: int
    rank: int
    raw_samples: int
    ready_batches: int
    samples: int
    samples_per_second: float
    scratch_samples: int
    shm: bool
    user: str
    verdict: str
    wait_ratio: float
    wait_seconds: float
    world_size: int
    def __init__(self, id: _Optional[int] = ..., dataset: _Optional[str] = ..., user: _Optional[str] = ..., pid: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., epoch: _Optional[int] = ..., batches: _Optional[int] = ..., num_batches: _Optional[int] = ..., samples: _Optional[int] = ..., open_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., wait_ratio: _Optional[float] = ..., verdict: _Optional[str] = ..., shm: bool = ..., job: _Optional[str] = ..., measured_by_client: bool = ..., samples_per_second: _Optional[float] = ..., bytes_per_second: _Optional[float] = ..., memory_samples: _Optional[int] = ..., scratch_samples: _Optional[int] = ..., raw_samples: _Optional[int] = ..., cause: _Optional[str] = ..., advice: _Optional[str] = ..., ready_batches: _Optional[int] = ..., input_bound_above: _Optional[float] = ..., compute_bound_below: _Optional[float] = ...) -> None: ...

class StreamPlan(_message.Message):
    __slots__ = ["num_batches", "num_samples", "prefetch_batches", "slot_bytes"]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_batches: int
    num_samples: int
    prefetch_batches: int
    slot_bytes: int
    def __init__(self, num_batches: _Optional[int] = ..., num_samples: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., prefetch_batches: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ["bytes", "hits", "tier"]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    hits: int
    tier: str
    def __init__(self, tier: _Optional[str] = ..., hits: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class UnavailableDataset(_message.Message):
    __slots__ = ["name", "reason"]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WarmProgress(_message.Message):
    __slots__ = ["bad", "done", "present", "total", "written"]
    BAD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bad: int
    done: int
    present: int
    total: int
    written: int
    def __init__(self, done: _Optional[int] = ..., total: _Optional[int] = ..., written: _Optional[int] = ..., present: _Optional[int] = ..., bad: _Optional[int] = ...) -> None: ...

class WarmRequest(_message.Message):
    __slots__ = ["dataset"]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    def __init__(self, dataset: _Optional[str] = ...) -> None: ...

class ApiVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class VariableLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
