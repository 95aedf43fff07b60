from swarmgrad.protocol.v1 import auth_pb2 as _auth_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ("run_id", "spec_hash", "challenge", "round", "group_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec_hash: bytes
    challenge: bytes
    round: int
    group_id: bytes
    def __init__(self, run_id: _Optional[str] = ..., spec_hash: _Optional[bytes] = ..., challenge: _Optional[bytes] = ..., round: _Optional[int] = ..., group_id: _Optional[bytes] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("protocol_version", "peer_id", "software_version", "codecs", "public_key", "signature", "left_round")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    LEFT_ROUND_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    peer_id: str
    software_version: str
    codecs: _containers.RepeatedScalarFieldContainer[str]
    public_key: bytes
    signature: bytes
    left_round: bool
    def __init__(self, protocol_version: _Optional[int] = ..., peer_id: _Optional[str] = ..., software_version: _Optional[str] = ..., codecs: _Optional[_Iterable[str]] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., left_round: _Optional[bool] = ...) -> None: ...

class DialBackRequest(_message.Message):
    __slots__ = ("run_id", "spec_hash", "port", "peer_id", "receiver", "auth")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec_hash: bytes
    port: int
    peer_id: str
    receiver: str
    auth: _auth_pb2.Auth
    def __init__(self, run_id: _Optional[str] = ..., spec_hash: _Optional[bytes] = ..., port: _Optional[int] = ..., peer_id: _Optional[str] = ..., receiver: _Optional[str] = ..., auth: _Optional[_Union[_auth_pb2.Auth, _Mapping]] = ...) -> None: ...

class DialBackReply(_message.Message):
    __slots__ = ("reachable", "observed_host", "detail", "observed_port")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_HOST_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_PORT_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    observed_host: str
    detail: str
    observed_port: int
    def __init__(self, reachable: _Optional[bool] = ..., observed_host: _Optional[str] = ..., detail: _Optional[str] = ..., observed_port: _Optional[int] = ...) -> None: ...

class PunchRequest(_message.Message):
    __slots__ = ("run_id", "spec_hash", "peer_id", "host", "port", "receiver", "auth")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_HASH_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec_hash: bytes
    peer_id: str
    host: str
    port: int
    receiver: str
    auth: _auth_pb2.Auth
    def __init__(self, run_id: _Optional[str] = ..., spec_hash: _Optional[bytes] = ..., peer_id: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., receiver: _Optional[str] = ..., auth: _Optional[_Union[_auth_pb2.Auth, _Mapping]] = ...) -> None: ...

class PunchReply(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...
