from swarmgrad.protocol.v1 import auth_pb2 as _auth_pb2
from swarmgrad.protocol.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResultCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESULT_CODE_UNSPECIFIED: _ClassVar[ResultCode]
    OK: _ClassVar[ResultCode]
    WRONG_RUN: _ClassVar[ResultCode]
    UNKNOWN_ROUND: _ClassVar[ResultCode]
    NOT_A_MEMBER: _ClassVar[ResultCode]
    BAD_CODEC: _ClassVar[ResultCode]
    BAD_SHAPE: _ClassVar[ResultCode]
    BAD_PAYLOAD: _ClassVar[ResultCode]
    NON_FINITE: _ClassVar[ResultCode]
    TOO_LARGE: _ClassVar[ResultCode]
    DUPLICATE_PART: _ClassVar[ResultCode]
    OVERLOADED: _ClassVar[ResultCode]
    TIMED_OUT: _ClassVar[ResultCode]
    ABORTED: _ClassVar[ResultCode]
    UNAUTHENTICATED: _ClassVar[ResultCode]
    UNKNOWN_STATE: _ClassVar[ResultCode]
    WRONG_ADDRESS: _ClassVar[ResultCode]
    CANNOT_PUNCH: _ClassVar[ResultCode]
    BANNED: _ClassVar[ResultCode]
    NOT_ALLOWED: _ClassVar[ResultCode]
RESULT_CODE_UNSPECIFIED: ResultCode
OK: ResultCode
WRONG_RUN: ResultCode
UNKNOWN_ROUND: ResultCode
NOT_A_MEMBER: ResultCode
BAD_CODEC: ResultCode
BAD_SHAPE: ResultCode
BAD_PAYLOAD: ResultCode
NON_FINITE: ResultCode
TOO_LARGE: ResultCode
DUPLICATE_PART: ResultCode
OVERLOADED: ResultCode
TIMED_OUT: ResultCode
ABORTED: ResultCode
UNAUTHENTICATED: ResultCode
UNKNOWN_STATE: ResultCode
WRONG_ADDRESS: ResultCode
CANNOT_PUNCH: ResultCode
BANNED: ResultCode
NOT_ALLOWED: ResultCode

class RoundKey(_message.Message):
    __slots__ = ("run_id", "spec_hash", "round", "group_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec_hash: bytes
    round: int
    group_id: bytes
    def __init__(self, run_id: _Optional[str] = ..., spec_hash: _Optional[bytes] = ..., round: _Optional[int] = ..., group_id: _Optional[bytes] = ...) -> None: ...

class PartHeader(_message.Message):
    __slots__ = ("key", "sender", "part", "weight", "receiver", "auth")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    key: RoundKey
    sender: str
    part: int
    weight: float
    receiver: str
    auth: _auth_pb2.Auth
    def __init__(self, key: _Optional[_Union[RoundKey, _Mapping]] = ..., sender: _Optional[str] = ..., part: _Optional[int] = ..., weight: _Optional[float] = ..., receiver: _Optional[str] = ..., auth: _Optional[_Union[_auth_pb2.Auth, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "meta", "payload")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    index: int
    meta: _tensor_pb2.CodecMeta
    payload: bytes
    def __init__(self, index: _Optional[int] = ..., meta: _Optional[_Union[_tensor_pb2.CodecMeta, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class AggregateRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PartHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PartHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class AggregateResponse(_message.Message):
    __slots__ = ("chunk", "contributors")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    contributors: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., contributors: _Optional[_Iterable[int]] = ...) -> None: ...
