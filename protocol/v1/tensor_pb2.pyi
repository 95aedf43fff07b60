from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CodecMeta(_message.Message):
    __slots__ = ("codec", "version", "shape", "dtype", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CODEC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    codec: str
    version: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    params: _containers.ScalarMap[str, int]
    def __init__(self, codec: _Optional[str] = ..., version: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., params: _Optional[_Mapping[str, int]] = ...) -> None: ...

class EncodedTensor(_message.Message):
    __slots__ = ("meta", "payload")
    META_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    meta: CodecMeta
    payload: bytes
    def __init__(self, meta: _Optional[_Union[CodecMeta, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...
