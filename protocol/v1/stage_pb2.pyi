from swarmgrad.protocol.v1 import auth_pb2 as _auth_pb2
from swarmgrad.protocol.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MicrobatchId(_message.Message):
    __slots__ = ("trainer", "step", "index", "attempt")
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    trainer: str
    step: int
    index: int
    attempt: int
    def __init__(self, trainer: _Optional[str] = ..., step: _Optional[int] = ..., index: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class StageHeader(_message.Message):
    __slots__ = ("run_id", "spec_hash", "stage", "id", "receiver", "auth")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec_hash: bytes
    stage: int
    id: MicrobatchId
    receiver: str
    auth: _auth_pb2.Auth
    def __init__(self, run_id: _Optional[str] = ..., spec_hash: _Optional[bytes] = ..., stage: _Optional[int] = ..., id: _Optional[_Union[MicrobatchId, _Mapping]] = ..., receiver: _Optional[str] = ..., auth: _Optional[_Union[_auth_pb2.Auth, _Mapping]] = ...) -> None: ...

class StageInputs(_message.Message):
    __slots__ = ("tokens", "batch", "activations")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    batch: int
    activations: _tensor_pb2.EncodedTensor
    def __init__(self, tokens: _Optional[bytes] = ..., batch: _Optional[int] = ..., activations: _Optional[_Union[_tensor_pb2.EncodedTensor, _Mapping]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("header", "inputs")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    header: StageHeader
    inputs: StageInputs
    def __init__(self, header: _Optional[_Union[StageHeader, _Mapping]] = ..., inputs: _Optional[_Union[StageInputs, _Mapping]] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("version", "outputs", "compute_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    outputs: _tensor_pb2.EncodedTensor
    compute_seconds: float
    def __init__(self, version: _Optional[int] = ..., outputs: _Optional[_Union[_tensor_pb2.EncodedTensor, _Mapping]] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class ForwardLossRequest(_message.Message):
    __slots__ = ("header", "inputs", "labels", "loss_scale")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    header: StageHeader
    inputs: StageInputs
    labels: bytes
    loss_scale: float
    def __init__(self, header: _Optional[_Union[StageHeader, _Mapping]] = ..., inputs: _Optional[_Union[StageInputs, _Mapping]] = ..., labels: _Optional[bytes] = ..., loss_scale: _Optional[float] = ...) -> None: ...

class ForwardLossReply(_message.Message):
    __slots__ = ("version", "loss", "grad_inputs", "compute_seconds", "samples_accumulated")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_ACCUMULATED_FIELD_NUMBER: _ClassVar[int]
    version: int
    loss: float
    grad_inputs: _tensor_pb2.EncodedTensor
    compute_seconds: float
    samples_accumulated: int
    def __init__(self, version: _Optional[int] = ..., loss: _Optional[float] = ..., grad_inputs: _Optional[_Union[_tensor_pb2.EncodedTensor, _Mapping]] = ..., compute_seconds: _Optional[float] = ..., samples_accumulated: _Optional[int] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("header", "version", "grad_outputs", "inputs")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    header: StageHeader
    version: int
    grad_outputs: _tensor_pb2.EncodedTensor
    inputs: StageInputs
    def __init__(self, header: _Optional[_Union[StageHeader, _Mapping]] = ..., version: _Optional[int] = ..., grad_outputs: _Optional[_Union[_tensor_pb2.EncodedTensor, _Mapping]] = ..., inputs: _Optional[_Union[StageInputs, _Mapping]] = ...) -> None: ...

class BackwardReply(_message.Message):
    __slots__ = ("version", "grad_inputs", "compute_seconds", "samples_accumulated")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_ACCUMULATED_FIELD_NUMBER: _ClassVar[int]
    version: int
    grad_inputs: _tensor_pb2.EncodedTensor
    compute_seconds: float
    samples_accumulated: int
    def __init__(self, version: _Optional[int] = ..., grad_inputs: _Optional[_Union[_tensor_pb2.EncodedTensor, _Mapping]] = ..., compute_seconds: _Optional[float] = ..., samples_accumulated: _Optional[int] = ...) -> None: ...

class StageInfoRequest(_message.Message):
    __slots__ = ("run_id", "spec_hash")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec_hash: bytes
    def __init__(self, run_id: _Optional[str] = ..., spec_hash: _Optional[bytes] = ...) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("peer_id", "stage", "layer_start", "layer_end", "version", "epoch", "state", "samples_per_second", "queue_depth", "parameter_bytes", "activations", "gradients")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    stage: int
    layer_start: int
    layer_end: int
    version: int
    epoch: int
    state: str
    samples_per_second: float
    queue_depth: int
    parameter_bytes: int
    activations: str
    gradients: str
    def __init__(self, peer_id: _Optional[str] = ..., stage: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., version: _Optional[int] = ..., epoch: _Optional[int] = ..., state: _Optional[str] = ..., samples_per_second: _Optional[float] = ..., queue_depth: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., activations: _Optional[str] = ..., gradients: _Optional[str] = ...) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("header", "round")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    header: StageHeader
    round: int
    def __init__(self, header: _Optional[_Union[StageHeader, _Mapping]] = ..., round: _Optional[int] = ...) -> None: ...

class SyncReply(_message.Message):
    __slots__ = ("epoch", "outcome")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    outcome: str
    def __init__(self, epoch: _Optional[int] = ..., outcome: _Optional[str] = ...) -> None: ...
