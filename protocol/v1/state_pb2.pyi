from swarmgrad.protocol.v1 import auth_pb2 as _auth_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateRequest(_message.Message):
    __slots__ = ("run_id", "spec_hash", "root", "first_chunk", "num_chunks", "receiver", "auth")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec_hash: bytes
    root: str
    first_chunk: int
    num_chunks: int
    receiver: str
    auth: _auth_pb2.Auth
    def __init__(self, run_id: _Optional[str] = ..., spec_hash: _Optional[bytes] = ..., root: _Optional[str] = ..., first_chunk: _Optional[int] = ..., num_chunks: _Optional[int] = ..., receiver: _Optional[str] = ..., auth: _Optional[_Union[_auth_pb2.Auth, _Mapping]] = ...) -> None: ...

class StateManifest(_message.Message):
    __slots__ = ("epoch", "num_values", "chunk_values", "digests")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_VALUES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_VALUES_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_values: int
    chunk_values: int
    digests: bytes
    def __init__(self, epoch: _Optional[int] = ..., num_values: _Optional[int] = ..., chunk_values: _Optional[int] = ..., digests: _Optional[bytes] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("index", "values")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    index: int
    values: bytes
    def __init__(self, index: _Optional[int] = ..., values: _Optional[bytes] = ...) -> None: ...
