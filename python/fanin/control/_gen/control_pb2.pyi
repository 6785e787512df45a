from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_MODE_AGGREGATE: _ClassVar[JobMode]
    JOB_MODE_FORWARD: _ClassVar[JobMode]

class FailurePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_POLICY_DEGRADE: _ClassVar[FailurePolicy]
    FAILURE_POLICY_FAIL: _ClassVar[FailurePolicy]

class KvValueType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_VALUE_TYPE_INT64: _ClassVar[KvValueType]
    KV_VALUE_TYPE_FLOAT64: _ClassVar[KvValueType]
JOB_MODE_AGGREGATE: JobMode
JOB_MODE_FORWARD: JobMode
FAILURE_POLICY_DEGRADE: FailurePolicy
FAILURE_POLICY_FAIL: FailurePolicy
KV_VALUE_TYPE_INT64: KvValueType
KV_VALUE_TYPE_FLOAT64: KvValueType

class JobSpec(_message.Message):
    __slots__ = ("job_id", "members", "block_cnt_max", "block_grad_max", "block_exp_ms", "mode", "slow_after_windows", "workers", "tree", "key", "on_failure", "member_timeout_ms", "rate_limit", "result_group", "quorum", "resumed")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CNT_MAX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_GRAD_MAX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EXP_MS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SLOW_AFTER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ON_FAILURE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    RESULT_GROUP_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    members: _containers.RepeatedScalarFieldContainer[int]
    block_cnt_max: int
    block_grad_max: int
    block_exp_ms: int
    mode: JobMode
    slow_after_windows: int
    workers: int
    tree: TreeRole
    key: bytes
    on_failure: FailurePolicy
    member_timeout_ms: int
    rate_limit: RateLimit
    result_group: str
    quorum: int
    resumed: bool
    def __init__(self, job_id: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., block_cnt_max: _Optional[int] = ..., block_grad_max: _Optional[int] = ..., block_exp_ms: _Optional[int] = ..., mode: _Optional[_Union[JobMode, str]] = ..., slow_after_windows: _Optional[int] = ..., workers: _Optional[int] = ..., tree: _Optional[_Union[TreeRole, _Mapping]] = ..., key: _Optional[bytes] = ..., on_failure: _Optional[_Union[FailurePolicy, str]] = ..., member_timeout_ms: _Optional[int] = ..., rate_limit: _Optional[_Union[RateLimit, _Mapping]] = ..., result_group: _Optional[str] = ..., quorum: _Optional[int] = ..., resumed: _Optional[bool] = ...) -> None: ...

class RateLimit(_message.Message):
    __slots__ = ("pps", "burst")
    PPS_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    pps: int
    burst: int
    def __init__(self, pps: _Optional[int] = ..., burst: _Optional[int] = ...) -> None: ...

class TreeRole(_message.Message):
    __slots__ = ("parent_addr", "parent_shards", "rank")
    PARENT_ADDR_FIELD_NUMBER: _ClassVar[int]
    PARENT_SHARDS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    parent_addr: str
    parent_shards: int
    rank: int
    def __init__(self, parent_addr: _Optional[str] = ..., parent_shards: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class NextHop(_message.Message):
    __slots__ = ("addr", "shards")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    addr: str
    shards: int
    def __init__(self, addr: _Optional[str] = ..., shards: _Optional[int] = ...) -> None: ...

class InstallTransitRequest(_message.Message):
    __slots__ = ("job_id", "next", "sources")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    next: NextHop
    sources: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[int] = ..., next: _Optional[_Union[NextHop, _Mapping]] = ..., sources: _Optional[_Iterable[int]] = ...) -> None: ...

class InstallTransitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveTransitRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    def __init__(self, job_id: _Optional[int] = ...) -> None: ...

class RemoveTransitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("api_version", "version", "data_addr", "shard_count", "incarnation", "memory_limit", "memory_used", "packet_elems_max")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDR_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    PACKET_ELEMS_MAX_FIELD_NUMBER: _ClassVar[int]
    api_version: str
    version: str
    data_addr: str
    shard_count: int
    incarnation: int
    memory_limit: int
    memory_used: int
    packet_elems_max: int
    def __init__(self, api_version: _Optional[str] = ..., version: _Optional[str] = ..., data_addr: _Optional[str] = ..., shard_count: _Optional[int] = ..., incarnation: _Optional[int] = ..., memory_limit: _Optional[int] = ..., memory_used: _Optional[int] = ..., packet_elems_max: _Optional[int] = ...) -> None: ...

class AdmitJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ...) -> None: ...

class AdmitJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    def __init__(self, job_id: _Optional[int] = ...) -> None: ...

class RemoveJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobSpec]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobSpec, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class UpdateJobRequest(_message.Message):
    __slots__ = ("spec", "awaiting")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    AWAITING_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    awaiting: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., awaiting: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCountersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Counter(_message.Message):
    __slots__ = ("name", "reason", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    value: int
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...

class GetCountersResponse(_message.Message):
    __slots__ = ("counters",)
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.RepeatedCompositeFieldContainer[Counter]
    def __init__(self, counters: _Optional[_Iterable[_Union[Counter, _Mapping]]] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("job_id", "block_cnt_max", "block_grad_max", "block_exp_ms", "slow_after_windows", "max_workers", "on_failure", "member_timeout_ms", "auth")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CNT_MAX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_GRAD_MAX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EXP_MS_FIELD_NUMBER: _ClassVar[int]
    SLOW_AFTER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ON_FAILURE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    block_cnt_max: int
    block_grad_max: int
    block_exp_ms: int
    slow_after_windows: int
    max_workers: int
    on_failure: FailurePolicy
    member_timeout_ms: int
    auth: bool
    def __init__(self, job_id: _Optional[int] = ..., block_cnt_max: _Optional[int] = ..., block_grad_max: _Optional[int] = ..., block_exp_ms: _Optional[int] = ..., slow_after_windows: _Optional[int] = ..., max_workers: _Optional[int] = ..., on_failure: _Optional[_Union[FailurePolicy, str]] = ..., member_timeout_ms: _Optional[int] = ..., auth: _Optional[bool] = ...) -> None: ...

class CreateJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    def __init__(self, job_id: _Optional[int] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("job_id", "rank", "host", "sync")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    rank: int
    host: str
    sync: bool
    def __init__(self, job_id: _Optional[int] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., sync: _Optional[bool] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("data_addr", "programmed", "member_key")
    DATA_ADDR_FIELD_NUMBER: _ClassVar[int]
    PROGRAMMED_FIELD_NUMBER: _ClassVar[int]
    MEMBER_KEY_FIELD_NUMBER: _ClassVar[int]
    data_addr: str
    programmed: _containers.RepeatedScalarFieldContainer[str]
    member_key: bytes
    def __init__(self, data_addr: _Optional[str] = ..., programmed: _Optional[_Iterable[str]] = ..., member_key: _Optional[bytes] = ...) -> None: ...

class UnsubscribeRequest(_message.Message):
    __slots__ = ("job_id", "rank")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    rank: int
    def __init__(self, job_id: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class UnsubscribeResponse(_message.Message):
    __slots__ = ("programmed",)
    PROGRAMMED_FIELD_NUMBER: _ClassVar[int]
    programmed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, programmed: _Optional[_Iterable[str]] = ...) -> None: ...

class GetTreeRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    def __init__(self, job_id: _Optional[int] = ...) -> None: ...

class GetTreeResponse(_message.Message):
    __slots__ = ("tree_json",)
    TREE_JSON_FIELD_NUMBER: _ClassVar[int]
    tree_json: str
    def __init__(self, tree_json: _Optional[str] = ...) -> None: ...

class KvRegionSpec(_message.Message):
    __slots__ = ("task_id", "tenant", "receiver_addr", "short_slots", "medium_groups", "medium_parts", "aa_size", "shadow_copies", "window", "max_channels", "idle_timeout_ms", "key", "value_type")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ADDR_FIELD_NUMBER: _ClassVar[int]
    SHORT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    AA_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHADOW_COPIES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_TYPE_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    tenant: int
    receiver_addr: str
    short_slots: int
    medium_groups: int
    medium_parts: int
    aa_size: int
    shadow_copies: bool
    window: int
    max_channels: int
    idle_timeout_ms: int
    key: bytes
    value_type: KvValueType
    def __init__(self, task_id: _Optional[int] = ..., tenant: _Optional[int] = ..., receiver_addr: _Optional[str] = ..., short_slots: _Optional[int] = ..., medium_groups: _Optional[int] = ..., medium_parts: _Optional[int] = ..., aa_size: _Optional[int] = ..., shadow_copies: _Optional[bool] = ..., window: _Optional[int] = ..., max_channels: _Optional[int] = ..., idle_timeout_ms: _Optional[int] = ..., key: _Optional[bytes] = ..., value_type: _Optional[_Union[KvValueType, str]] = ...) -> None: ...

class AllocKvRegionRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: KvRegionSpec
    def __init__(self, spec: _Optional[_Union[KvRegionSpec, _Mapping]] = ...) -> None: ...

class AllocKvRegionResponse(_message.Message):
    __slots__ = ("data_addr", "memory_bytes")
    DATA_ADDR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    data_addr: str
    memory_bytes: int
    def __init__(self, data_addr: _Optional[str] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class ReleaseKvRegionRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    def __init__(self, task_id: _Optional[int] = ...) -> None: ...

class ReleaseKvRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListKvRegionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvRegion(_message.Message):
    __slots__ = ("spec", "data_addr", "tuples_in", "tuples_aggregated", "packets_acked", "packets_forwarded", "swaps")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDR_FIELD_NUMBER: _ClassVar[int]
    TUPLES_IN_FIELD_NUMBER: _ClassVar[int]
    TUPLES_AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    PACKETS_ACKED_FIELD_NUMBER: _ClassVar[int]
    PACKETS_FORWARDED_FIELD_NUMBER: _ClassVar[int]
    SWAPS_FIELD_NUMBER: _ClassVar[int]
    spec: KvRegionSpec
    data_addr: str
    tuples_in: int
    tuples_aggregated: int
    packets_acked: int
    packets_forwarded: int
    swaps: int
    def __init__(self, spec: _Optional[_Union[KvRegionSpec, _Mapping]] = ..., data_addr: _Optional[str] = ..., tuples_in: _Optional[int] = ..., tuples_aggregated: _Optional[int] = ..., packets_acked: _Optional[int] = ..., packets_forwarded: _Optional[int] = ..., swaps: _Optional[int] = ...) -> None: ...

class ListKvRegionsResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[KvRegion]
    def __init__(self, regions: _Optional[_Iterable[_Union[KvRegion, _Mapping]]] = ...) -> None: ...
