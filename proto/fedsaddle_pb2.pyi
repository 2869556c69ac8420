from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_2: _ClassVar[ProtocolVersion]

class ElementType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLOAT64: _ClassVar[ElementType]
    FLOAT32: _ClassVar[ElementType]

class TaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_KIND_UNSPECIFIED: _ClassVar[TaskKind]
    GRADIENT: _ClassVar[TaskKind]
    LOCAL_STEPS: _ClassVar[TaskKind]
    EVALUATE: _ClassVar[TaskKind]
    COMPUTE: _ClassVar[TaskKind]

class Correction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CORRECTION_UNSPECIFIED: _ClassVar[Correction]
    NONE: _ClassVar[Correction]
    SCAFFOLD: _ClassVar[Correction]

class StepDecay(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_DECAY_UNSPECIFIED: _ClassVar[StepDecay]
    CONSTANT: _ClassVar[StepDecay]
    INVERSE_SQRT: _ClassVar[StepDecay]

class RejectCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_CODE_UNSPECIFIED: _ClassVar[RejectCode]
    INVALID_ARGUMENT: _ClassVar[RejectCode]
    ALREADY_EXISTS: _ClassVar[RejectCode]
    PERMISSION_DENIED: _ClassVar[RejectCode]
    FAILED_PRECONDITION: _ClassVar[RejectCode]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    DONE: _ClassVar[Outcome]
    FAILED: _ClassVar[Outcome]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
PROTOCOL_VERSION_2: ProtocolVersion
FLOAT64: ElementType
FLOAT32: ElementType
TASK_KIND_UNSPECIFIED: TaskKind
GRADIENT: TaskKind
LOCAL_STEPS: TaskKind
EVALUATE: TaskKind
COMPUTE: TaskKind
CORRECTION_UNSPECIFIED: Correction
NONE: Correction
SCAFFOLD: Correction
STEP_DECAY_UNSPECIFIED: StepDecay
CONSTANT: StepDecay
INVERSE_SQRT: StepDecay
REJECT_CODE_UNSPECIFIED: RejectCode
INVALID_ARGUMENT: RejectCode
ALREADY_EXISTS: RejectCode
PERMISSION_DENIED: RejectCode
FAILED_PRECONDITION: RejectCode
OUTCOME_UNSPECIFIED: Outcome
DONE: Outcome
FAILED: Outcome

class ClientMessage(_message.Message):
    __slots__ = ("hello", "ready", "answer", "chunk", "unmasked", "failure")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    UNMASKED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    ready: Ready
    answer: Answer
    chunk: Chunk
    unmasked: UnmaskReply
    failure: Failure
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., ready: _Optional[_Union[Ready, _Mapping]] = ..., answer: _Optional[_Union[Answer, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., unmasked: _Optional[_Union[UnmaskReply, _Mapping]] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("run_id", "round_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round_id: int
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., round_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "client_indices", "client_name")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    client_indices: _containers.RepeatedScalarFieldContainer[int]
    client_name: str
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., client_indices: _Optional[_Iterable[int]] = ..., client_name: _Optional[str] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("run_id", "dimension", "sample_counts", "error", "numeric_stack", "public_keys", "element_type")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUMERIC_STACK_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEYS_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    dimension: int
    sample_counts: _containers.RepeatedScalarFieldContainer[int]
    error: str
    numeric_stack: str
    public_keys: _containers.RepeatedScalarFieldContainer[bytes]
    element_type: ElementType
    def __init__(self, run_id: _Optional[str] = ..., dimension: _Optional[int] = ..., sample_counts: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., numeric_stack: _Optional[str] = ..., public_keys: _Optional[_Iterable[bytes]] = ..., element_type: _Optional[_Union[ElementType, str]] = ...) -> None: ...

class Answer(_message.Message):
    __slots__ = ("run_id", "round_id", "client_indices", "payload_length", "payload", "objective", "diverged", "sample_counts", "masked", "shares", "diverged_reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round_id: int
    client_indices: _containers.RepeatedScalarFieldContainer[int]
    payload_length: int
    payload: bytes
    objective: bytes
    diverged: bool
    sample_counts: _containers.RepeatedScalarFieldContainer[int]
    masked: bool
    shares: _containers.RepeatedCompositeFieldContainer[SealedShares]
    diverged_reason: str
    def __init__(self, run_id: _Optional[str] = ..., round_id: _Optional[int] = ..., client_indices: _Optional[_Iterable[int]] = ..., payload_length: _Optional[int] = ..., payload: _Optional[bytes] = ..., objective: _Optional[bytes] = ..., diverged: _Optional[bool] = ..., sample_counts: _Optional[_Iterable[int]] = ..., masked: _Optional[bool] = ..., shares: _Optional[_Iterable[_Union[SealedShares, _Mapping]]] = ..., diverged_reason: _Optional[str] = ...) -> None: ...

class SealedShares(_message.Message):
    __slots__ = ("holders", "sealed")
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedScalarFieldContainer[int]
    sealed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, holders: _Optional[_Iterable[int]] = ..., sealed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UnmaskReply(_message.Message):
    __slots__ = ("run_id", "round_id", "client", "self_mask_shares", "pairwise_seeds", "error")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SELF_MASK_SHARES_FIELD_NUMBER: _ClassVar[int]
    PAIRWISE_SEEDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round_id: int
    client: int
    self_mask_shares: _containers.RepeatedCompositeFieldContainer[ClientValue]
    pairwise_seeds: _containers.RepeatedCompositeFieldContainer[ClientValue]
    error: str
    def __init__(self, run_id: _Optional[str] = ..., round_id: _Optional[int] = ..., client: _Optional[int] = ..., self_mask_shares: _Optional[_Iterable[_Union[ClientValue, _Mapping]]] = ..., pairwise_seeds: _Optional[_Iterable[_Union[ClientValue, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class ClientValue(_message.Message):
    __slots__ = ("client", "value")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    client: int
    value: bytes
    def __init__(self, client: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...

class Instruction(_message.Message):
    __slots__ = ("welcome", "run", "task", "chunk", "rejected", "goodbye", "keys", "unmask")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    UNMASK_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    run: RunSpec
    task: Task
    chunk: Chunk
    rejected: Rejected
    goodbye: Goodbye
    keys: KeyDirectory
    unmask: UnmaskRequest
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., run: _Optional[_Union[RunSpec, _Mapping]] = ..., task: _Optional[_Union[Task, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., rejected: _Optional[_Union[Rejected, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ..., keys: _Optional[_Union[KeyDirectory, _Mapping]] = ..., unmask: _Optional[_Union[UnmaskRequest, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("federation_id", "num_clients", "chunk_bytes")
    FEDERATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    federation_id: str
    num_clients: int
    chunk_bytes: int
    def __init__(self, federation_id: _Optional[str] = ..., num_clients: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("run_id", "problem_name", "problem_json", "synthetic_seed", "noise_seed", "gradient_noise", "dimension", "want_sample_counts", "secure_aggregation", "dp", "computations", "element_type")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_NAME_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_JSON_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_SEED_FIELD_NUMBER: _ClassVar[int]
    NOISE_SEED_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_NOISE_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    WANT_SAMPLE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SECURE_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    COMPUTATIONS_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    problem_name: str
    problem_json: str
    synthetic_seed: int
    noise_seed: int
    gradient_noise: float
    dimension: int
    want_sample_counts: bool
    secure_aggregation: SecureAggregation
    dp: DifferentialPrivacy
    computations: _containers.RepeatedScalarFieldContainer[str]
    element_type: ElementType
    def __init__(self, run_id: _Optional[str] = ..., problem_name: _Optional[str] = ..., problem_json: _Optional[str] = ..., synthetic_seed: _Optional[int] = ..., noise_seed: _Optional[int] = ..., gradient_noise: _Optional[float] = ..., dimension: _Optional[int] = ..., want_sample_counts: _Optional[bool] = ..., secure_aggregation: _Optional[_Union[SecureAggregation, _Mapping]] = ..., dp: _Optional[_Union[DifferentialPrivacy, _Mapping]] = ..., computations: _Optional[_Iterable[str]] = ..., element_type: _Optional[_Union[ElementType, str]] = ...) -> None: ...

class DifferentialPrivacy(_message.Message):
    __slots__ = ("clip", "noise_multiplier")
    CLIP_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    clip: float
    noise_multiplier: float
    def __init__(self, clip: _Optional[float] = ..., noise_multiplier: _Optional[float] = ...) -> None: ...

class SecureAggregation(_message.Message):
    __slots__ = ("threshold", "scale_bits", "bound", "weigh_by_samples", "neighbours")
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SCALE_BITS_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    WEIGH_BY_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    threshold: int
    scale_bits: int
    bound: float
    weigh_by_samples: bool
    neighbours: int
    def __init__(self, threshold: _Optional[int] = ..., scale_bits: _Optional[int] = ..., bound: _Optional[float] = ..., weigh_by_samples: _Optional[bool] = ..., neighbours: _Optional[int] = ...) -> None: ...

class KeyDirectory(_message.Message):
    __slots__ = ("run_id", "epoch", "keys")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    epoch: int
    keys: _containers.RepeatedCompositeFieldContainer[ClientValue]
    def __init__(self, run_id: _Optional[str] = ..., epoch: _Optional[int] = ..., keys: _Optional[_Iterable[_Union[ClientValue, _Mapping]]] = ...) -> None: ...

class UnmaskRequest(_message.Message):
    __slots__ = ("run_id", "round_id", "client", "answered", "dropped", "shares")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round_id: int
    client: int
    answered: _containers.RepeatedScalarFieldContainer[int]
    dropped: _containers.RepeatedScalarFieldContainer[int]
    shares: _containers.RepeatedCompositeFieldContainer[ClientValue]
    def __init__(self, run_id: _Optional[str] = ..., round_id: _Optional[int] = ..., client: _Optional[int] = ..., answered: _Optional[_Iterable[int]] = ..., dropped: _Optional[_Iterable[int]] = ..., shares: _Optional[_Iterable[_Union[ClientValue, _Mapping]]] = ...) -> None: ...

class GradientParams(_message.Message):
    __slots__ = ("batch", "exact", "want_objective")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    WANT_OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    batch: int
    exact: bool
    want_objective: bool
    def __init__(self, batch: _Optional[int] = ..., exact: _Optional[bool] = ..., want_objective: _Optional[bool] = ...) -> None: ...

class LocalSteps(_message.Message):
    __slots__ = ("steps", "gamma_local", "step_offset", "decay", "correction", "theta")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_LOCAL_FIELD_NUMBER: _ClassVar[int]
    STEP_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DECAY_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_FIELD_NUMBER: _ClassVar[int]
    THETA_FIELD_NUMBER: _ClassVar[int]
    steps: int
    gamma_local: float
    step_offset: int
    decay: StepDecay
    correction: Correction
    theta: float
    def __init__(self, steps: _Optional[int] = ..., gamma_local: _Optional[float] = ..., step_offset: _Optional[int] = ..., decay: _Optional[_Union[StepDecay, str]] = ..., correction: _Optional[_Union[Correction, str]] = ..., theta: _Optional[float] = ...) -> None: ...

class Compute(_message.Message):
    __slots__ = ("name", "array_names", "array_lengths", "params")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARRAY_NAMES_FIELD_NUMBER: _ClassVar[int]
    ARRAY_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    array_names: _containers.RepeatedScalarFieldContainer[str]
    array_lengths: _containers.RepeatedScalarFieldContainer[int]
    params: _containers.RepeatedCompositeFieldContainer[ComputeParam]
    def __init__(self, name: _Optional[str] = ..., array_names: _Optional[_Iterable[str]] = ..., array_lengths: _Optional[_Iterable[int]] = ..., params: _Optional[_Iterable[_Union[ComputeParam, _Mapping]]] = ...) -> None: ...

class ComputeParam(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("run_id", "round_id", "kind", "gradient", "local", "payload_length", "payload", "client_indices", "metric_names", "round_clients", "compute")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CLIENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    METRIC_NAMES_FIELD_NUMBER: _ClassVar[int]
    ROUND_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round_id: int
    kind: TaskKind
    gradient: GradientParams
    local: LocalSteps
    payload_length: int
    payload: bytes
    client_indices: _containers.RepeatedScalarFieldContainer[int]
    metric_names: _containers.RepeatedScalarFieldContainer[str]
    round_clients: _containers.RepeatedScalarFieldContainer[int]
    compute: Compute
    def __init__(self, run_id: _Optional[str] = ..., round_id: _Optional[int] = ..., kind: _Optional[_Union[TaskKind, str]] = ..., gradient: _Optional[_Union[GradientParams, _Mapping]] = ..., local: _Optional[_Union[LocalSteps, _Mapping]] = ..., payload_length: _Optional[int] = ..., payload: _Optional[bytes] = ..., client_indices: _Optional[_Iterable[int]] = ..., metric_names: _Optional[_Iterable[str]] = ..., round_clients: _Optional[_Iterable[int]] = ..., compute: _Optional[_Union[Compute, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Rejected(_message.Message):
    __slots__ = ("round_id", "code", "details")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    code: RejectCode
    details: str
    def __init__(self, round_id: _Optional[int] = ..., code: _Optional[_Union[RejectCode, str]] = ..., details: _Optional[str] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason", "outcome")
    REASON_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    reason: str
    outcome: Outcome
    def __init__(self, reason: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, str]] = ...) -> None: ...
