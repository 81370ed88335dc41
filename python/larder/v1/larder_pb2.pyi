from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VariableLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PADDED: _ClassVar[VariableLayout]
    OFFSETS: _ClassVar[VariableLayout]
PADDED: VariableLayout
OFFSETS: VariableLayout

class WarmRequest(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    def __init__(self, dataset: _Optional[str] = ...) -> None: ...

class WarmProgress(_message.Message):
    __slots__ = ("done", "total", "written", "present")
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    done: int
    total: int
    written: int
    present: int
    def __init__(self, done: _Optional[int] = ..., total: _Optional[int] = ..., written: _Optional[int] = ..., present: _Optional[int] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FieldInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "paired_with", "scale", "resample")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAIRED_WITH_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    paired_with: str
    scale: int
    resample: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., paired_with: _Optional[str] = ..., scale: _Optional[int] = ..., resample: _Optional[str] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("name", "num_samples", "sample_shape", "has_labels", "source", "sample_bytes", "fields")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    HAS_LABELS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_samples: int
    sample_shape: _containers.RepeatedScalarFieldContainer[int]
    has_labels: bool
    source: str
    sample_bytes: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldInfo]
    def __init__(self, name: _Optional[str] = ..., num_samples: _Optional[int] = ..., sample_shape: _Optional[_Iterable[int]] = ..., has_labels: _Optional[bool] = ..., source: _Optional[str] = ..., sample_bytes: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[FieldInfo, _Mapping]]] = ...) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class StreamBatchesRequest(_message.Message):
    __slots__ = ("dataset", "batch_size", "seed", "epoch", "rank", "world_size", "start_batch", "sequential", "drop_last", "fields", "variable_layout", "layout_version", "shm_ring", "held_slots", "worker", "num_workers", "start_sample", "start_step", "even_batches")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENTIAL_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    VARIABLE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHM_RING_FIELD_NUMBER: _ClassVar[int]
    HELD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    START_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    EVEN_BATCHES_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    batch_size: int
    seed: int
    epoch: int
    rank: int
    world_size: int
    start_batch: int
    sequential: bool
    drop_last: bool
    fields: _containers.RepeatedScalarFieldContainer[str]
    variable_layout: VariableLayout
    layout_version: int
    shm_ring: bytes
    held_slots: _containers.RepeatedScalarFieldContainer[int]
    worker: int
    num_workers: int
    start_sample: int
    start_step: int
    even_batches: bool
    def __init__(self, dataset: _Optional[str] = ..., batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., start_batch: _Optional[int] = ..., sequential: _Optional[bool] = ..., drop_last: _Optional[bool] = ..., fields: _Optional[_Iterable[str]] = ..., variable_layout: _Optional[_Union[VariableLayout, str]] = ..., layout_version: _Optional[int] = ..., shm_ring: _Optional[bytes] = ..., held_slots: _Optional[_Iterable[int]] = ..., worker: _Optional[int] = ..., num_workers: _Optional[int] = ..., start_sample: _Optional[int] = ..., start_step: _Optional[int] = ..., even_batches: _Optional[bool] = ...) -> None: ...

class FieldBatch(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "lengths", "offsets", "sample_shape", "slot_offset", "slot_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    lengths: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sample_shape: _containers.RepeatedScalarFieldContainer[int]
    slot_offset: int
    slot_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., lengths: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., sample_shape: _Optional[_Iterable[int]] = ..., slot_offset: _Optional[int] = ..., slot_bytes: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("batch_index", "num_batches", "shape", "data", "labels", "sample_ids", "fields", "slot", "step", "resume_sample")
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESUME_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    num_batches: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    labels: _containers.RepeatedScalarFieldContainer[int]
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    fields: _containers.RepeatedCompositeFieldContainer[FieldBatch]
    slot: int
    step: int
    resume_sample: int
    def __init__(self, batch_index: _Optional[int] = ..., num_batches: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., labels: _Optional[_Iterable[int]] = ..., sample_ids: _Optional[_Iterable[int]] = ..., fields: _Optional[_Iterable[_Union[FieldBatch, _Mapping]]] = ..., slot: _Optional[int] = ..., step: _Optional[int] = ..., resume_sample: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "hits", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    hits: int
    bytes: int
    def __init__(self, tier: _Optional[str] = ..., hits: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("tiers", "memory_bytes", "memory_budget_bytes", "memory_entries", "hit_rate", "client_stall_seconds", "batches_served", "samples_served", "bytes_served", "active_streams", "coalesced_fetches", "admissions_declined", "uptime_seconds", "machine_available_bytes", "measured_expansion_factor", "scratch_bytes", "scratch_budget_bytes", "scratch_corrupt_records", "scratch_paused", "planned_expansion_factor", "shm_rings", "shm_bytes", "shm_budget_bytes", "shm_batches", "shm_fallbacks")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SERVED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SERVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    COALESCED_FETCHES_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_DECLINED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MACHINE_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_EXPANSION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_CORRUPT_RECORDS_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_PAUSED_FIELD_NUMBER: _ClassVar[int]
    PLANNED_EXPANSION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    SHM_RINGS_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SHM_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    memory_bytes: int
    memory_budget_bytes: int
    memory_entries: int
    hit_rate: float
    client_stall_seconds: float
    batches_served: int
    samples_served: int
    bytes_served: int
    active_streams: int
    coalesced_fetches: int
    admissions_declined: int
    uptime_seconds: float
    machine_available_bytes: int
    measured_expansion_factor: float
    scratch_bytes: int
    scratch_budget_bytes: int
    scratch_corrupt_records: int
    scratch_paused: str
    planned_expansion_factor: float
    shm_rings: int
    shm_bytes: int
    shm_budget_bytes: int
    shm_batches: int
    shm_fallbacks: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., memory_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., memory_entries: _Optional[int] = ..., hit_rate: _Optional[float] = ..., client_stall_seconds: _Optional[float] = ..., batches_served: _Optional[int] = ..., samples_served: _Optional[int] = ..., bytes_served: _Optional[int] = ..., active_streams: _Optional[int] = ..., coalesced_fetches: _Optional[int] = ..., admissions_declined: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., machine_available_bytes: _Optional[int] = ..., measured_expansion_factor: _Optional[float] = ..., scratch_bytes: _Optional[int] = ..., scratch_budget_bytes: _Optional[int] = ..., scratch_corrupt_records: _Optional[int] = ..., scratch_paused: _Optional[str] = ..., planned_expansion_factor: _Optional[float] = ..., shm_rings: _Optional[int] = ..., shm_bytes: _Optional[int] = ..., shm_budget_bytes: _Optional[int] = ..., shm_batches: _Optional[int] = ..., shm_fallbacks: _Optional[int] = ...) -> None: ...
