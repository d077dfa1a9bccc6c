from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("session_id", "first_layer", "last_layer", "positions", "hidden", "capability", "prefix_hashes", "prefix_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    first_layer: int
    last_layer: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    hidden: Tensor
    capability: bytes
    prefix_hashes: _containers.RepeatedScalarFieldContainer[str]
    prefix_length: int
    def __init__(self, session_id: _Optional[str] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., capability: _Optional[bytes] = ..., prefix_hashes: _Optional[_Iterable[str]] = ..., prefix_length: _Optional[int] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("hidden", "compute_ms", "queue_ms", "batch_size")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    hidden: Tensor
    compute_ms: float
    queue_ms: float
    batch_size: int
    def __init__(self, hidden: _Optional[_Union[Tensor, _Mapping]] = ..., compute_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...

class ForwardBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ForwardRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ForwardRequest, _Mapping]]] = ...) -> None: ...

class ForwardItemResult(_message.Message):
    __slots__ = ("reply", "code", "message")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reply: ForwardResponse
    code: int
    message: str
    def __init__(self, reply: _Optional[_Union[ForwardResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ForwardBatchResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ForwardItemResult]
    def __init__(self, items: _Optional[_Iterable[_Union[ForwardItemResult, _Mapping]]] = ...) -> None: ...

class ChainHop(_message.Message):
    __slots__ = ("node_id", "address", "first_layer", "last_layer")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    first_layer: int
    last_layer: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ...) -> None: ...

class ChainItem(_message.Message):
    __slots__ = ("session_ids", "capabilities", "position", "hidden", "outputs", "worker_ms", "code", "message", "failed_node", "compute_ms", "batch_size")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_MS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    capabilities: _containers.RepeatedScalarFieldContainer[bytes]
    position: int
    hidden: Tensor
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    worker_ms: _containers.RepeatedScalarFieldContainer[float]
    code: int
    message: str
    failed_node: str
    compute_ms: _containers.RepeatedScalarFieldContainer[float]
    batch_size: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., capabilities: _Optional[_Iterable[bytes]] = ..., position: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., worker_ms: _Optional[_Iterable[float]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., failed_node: _Optional[str] = ..., compute_ms: _Optional[_Iterable[float]] = ..., batch_size: _Optional[_Iterable[int]] = ...) -> None: ...

class ChainRequest(_message.Message):
    __slots__ = ("hops", "hop", "items", "deliver_to", "ticket")
    HOPS_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    DELIVER_TO_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    hops: _containers.RepeatedCompositeFieldContainer[ChainHop]
    hop: int
    items: _containers.RepeatedCompositeFieldContainer[ChainItem]
    deliver_to: str
    ticket: bytes
    def __init__(self, hops: _Optional[_Iterable[_Union[ChainHop, _Mapping]]] = ..., hop: _Optional[int] = ..., items: _Optional[_Iterable[_Union[ChainItem, _Mapping]]] = ..., deliver_to: _Optional[str] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class ChainAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("node_id", "served_layers", "latency_ms", "load", "served_requests", "failed_requests", "alive", "capacity_score", "active_sessions", "cache_bytes", "cache_bytes_limit", "draining", "model_sha256", "cached_prefixes", "prefix_hits", "prefix_tokens_reused", "max_sessions", "max_sessions_per_caller")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SERVED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_SCORE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_REUSED_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_PER_CALLER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    served_layers: _containers.RepeatedCompositeFieldContainer[LayerRange]
    latency_ms: float
    load: float
    served_requests: int
    failed_requests: int
    alive: bool
    capacity_score: float
    active_sessions: int
    cache_bytes: int
    cache_bytes_limit: int
    draining: bool
    model_sha256: str
    cached_prefixes: _containers.RepeatedScalarFieldContainer[str]
    prefix_hits: int
    prefix_tokens_reused: int
    max_sessions: int
    max_sessions_per_caller: int
    def __init__(self, node_id: _Optional[str] = ..., served_layers: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., latency_ms: _Optional[float] = ..., load: _Optional[float] = ..., served_requests: _Optional[int] = ..., failed_requests: _Optional[int] = ..., alive: _Optional[bool] = ..., capacity_score: _Optional[float] = ..., active_sessions: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_bytes_limit: _Optional[int] = ..., draining: _Optional[bool] = ..., model_sha256: _Optional[str] = ..., cached_prefixes: _Optional[_Iterable[str]] = ..., prefix_hits: _Optional[int] = ..., prefix_tokens_reused: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_sessions_per_caller: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("node_id", "address", "served_layers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    served_layers: _containers.RepeatedCompositeFieldContainer[LayerRange]
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., served_layers: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("added", "heartbeat_s")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    added: bool
    heartbeat_s: float
    def __init__(self, added: _Optional[bool] = ..., heartbeat_s: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...
