from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateRequest(_message.Message):
    __slots__ = ("run_id", "spec_hash")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec_hash: bytes
    def __init__(self, run_id: _Optional[str] = ..., spec_hash: _Optional[bytes] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("epoch", "num_values", "checksum")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_VALUES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_values: int
    checksum: str
    def __init__(self, epoch: _Optional[int] = ..., num_values: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("header", "values")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    values: bytes
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., values: _Optional[bytes] = ...) -> None: ...
