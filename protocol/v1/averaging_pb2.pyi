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
    NEED_INPUTS: _ClassVar[ResultCode]
    STALE_VERSION: _ClassVar[ResultCode]
    DRAINING: _ClassVar[ResultCode]
    WRONG_STAGE: _ClassVar[ResultCode]
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
NEED_INPUTS: ResultCode
STALE_VERSION: ResultCode
DRAINING: ResultCode
WRONG_STAGE: ResultCode

class Signed(_message.Message):
    __slots__ = ("body", "auth")
    BODY_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    auth: _auth_pb2.Auth
    def __init__(self, body: _Optional[bytes] = ..., auth: _Optional[_Union[_auth_pb2.Auth, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("key", "sender", "part", "weight", "receiver", "auth", "commitment")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    key: RoundKey
    sender: str
    part: int
    weight: float
    receiver: str
    auth: _auth_pb2.Auth
    commitment: bytes
    def __init__(self, key: _Optional[_Union[RoundKey, _Mapping]] = ..., sender: _Optional[str] = ..., part: _Optional[int] = ..., weight: _Optional[float] = ..., receiver: _Optional[str] = ..., auth: _Optional[_Union[_auth_pb2.Auth, _Mapping]] = ..., commitment: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("index", "meta", "payload", "signature")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    index: int
    meta: _tensor_pb2.CodecMeta
    payload: bytes
    signature: bytes
    def __init__(self, index: _Optional[int] = ..., meta: _Optional[_Union[_tensor_pb2.CodecMeta, _Mapping]] = ..., payload: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class AggregateRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PartHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PartHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class AggregateResponse(_message.Message):
    __slots__ = ("chunk", "contributors", "account")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    contributors: _containers.RepeatedScalarFieldContainer[int]
    account: Signed
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., contributors: _Optional[_Iterable[int]] = ..., account: _Optional[_Union[Signed, _Mapping]] = ...) -> None: ...

class ChunkAccount(_message.Message):
    __slots__ = ("result_sha256", "contributors", "clip", "payload_sha256")
    RESULT_SHA256_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    result_sha256: bytes
    contributors: _containers.RepeatedScalarFieldContainer[int]
    clip: _containers.RepeatedScalarFieldContainer[float]
    payload_sha256: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, result_sha256: _Optional[bytes] = ..., contributors: _Optional[_Iterable[int]] = ..., clip: _Optional[_Iterable[float]] = ..., payload_sha256: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PartAccount(_message.Message):
    __slots__ = ("key", "owner", "part", "chunks", "members", "commitments", "header_auths")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    COMMITMENTS_FIELD_NUMBER: _ClassVar[int]
    HEADER_AUTHS_FIELD_NUMBER: _ClassVar[int]
    key: RoundKey
    owner: str
    part: int
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkAccount]
    members: _containers.RepeatedScalarFieldContainer[int]
    commitments: _containers.RepeatedScalarFieldContainer[bytes]
    header_auths: _containers.RepeatedCompositeFieldContainer[_auth_pb2.Auth]
    def __init__(self, key: _Optional[_Union[RoundKey, _Mapping]] = ..., owner: _Optional[str] = ..., part: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[ChunkAccount, _Mapping]]] = ..., members: _Optional[_Iterable[int]] = ..., commitments: _Optional[_Iterable[bytes]] = ..., header_auths: _Optional[_Iterable[_Union[_auth_pb2.Auth, _Mapping]]] = ...) -> None: ...

class Reveal(_message.Message):
    __slots__ = ("secret", "accounts", "unaccounted")
    SECRET_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTS_FIELD_NUMBER: _ClassVar[int]
    UNACCOUNTED_FIELD_NUMBER: _ClassVar[int]
    secret: bytes
    accounts: _containers.RepeatedCompositeFieldContainer[Signed]
    unaccounted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, secret: _Optional[bytes] = ..., accounts: _Optional[_Iterable[_Union[Signed, _Mapping]]] = ..., unaccounted: _Optional[_Iterable[int]] = ...) -> None: ...

class PartReport(_message.Message):
    __slots__ = ("part", "projections", "payload_sha256", "seed")
    PART_FIELD_NUMBER: _ClassVar[int]
    PROJECTIONS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    part: int
    projections: _containers.RepeatedScalarFieldContainer[float]
    payload_sha256: _containers.RepeatedScalarFieldContainer[bytes]
    seed: bytes
    def __init__(self, part: _Optional[int] = ..., projections: _Optional[_Iterable[float]] = ..., payload_sha256: _Optional[_Iterable[bytes]] = ..., seed: _Optional[bytes] = ...) -> None: ...

class Report(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[PartReport]
    def __init__(self, parts: _Optional[_Iterable[_Union[PartReport, _Mapping]]] = ...) -> None: ...

class Accusation(_message.Message):
    __slots__ = ("part", "member", "report", "payloads")
    PART_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    part: int
    member: int
    report: Signed
    payloads: _containers.RepeatedCompositeFieldContainer[Chunk]
    def __init__(self, part: _Optional[int] = ..., member: _Optional[int] = ..., report: _Optional[_Union[Signed, _Mapping]] = ..., payloads: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("part", "chunk", "member")
    PART_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    part: int
    chunk: int
    member: int
    def __init__(self, part: _Optional[int] = ..., chunk: _Optional[int] = ..., member: _Optional[int] = ...) -> None: ...

class CheckStatement(_message.Message):
    __slots__ = ("key", "sender", "reveal", "report", "accusation", "audit")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    REVEAL_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    ACCUSATION_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    key: RoundKey
    sender: str
    reveal: Reveal
    report: Report
    accusation: Accusation
    audit: AuditRequest
    def __init__(self, key: _Optional[_Union[RoundKey, _Mapping]] = ..., sender: _Optional[str] = ..., reveal: _Optional[_Union[Reveal, _Mapping]] = ..., report: _Optional[_Union[Report, _Mapping]] = ..., accusation: _Optional[_Union[Accusation, _Mapping]] = ..., audit: _Optional[_Union[AuditRequest, _Mapping]] = ...) -> None: ...

class CheckReply(_message.Message):
    __slots__ = ("code", "payloads")
    CODE_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    code: ResultCode
    payloads: _containers.RepeatedCompositeFieldContainer[Chunk]
    def __init__(self, code: _Optional[_Union[ResultCode, str]] = ..., payloads: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("peer_id", "endpoint", "bandwidth", "weight")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    endpoint: str
    bandwidth: float
    weight: float
    def __init__(self, peer_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., bandwidth: _Optional[float] = ..., weight: _Optional[float] = ...) -> None: ...

class Evidence(_message.Message):
    __slots__ = ("reason", "accounts", "members", "member", "reveal")
    REASON_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    REVEAL_FIELD_NUMBER: _ClassVar[int]
    reason: str
    accounts: _containers.RepeatedCompositeFieldContainer[Signed]
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    member: int
    reveal: Signed
    def __init__(self, reason: _Optional[str] = ..., accounts: _Optional[_Iterable[_Union[Signed, _Mapping]]] = ..., members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ..., member: _Optional[int] = ..., reveal: _Optional[_Union[Signed, _Mapping]] = ...) -> None: ...

class EvidenceList(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Evidence]
    def __init__(self, items: _Optional[_Iterable[_Union[Evidence, _Mapping]]] = ...) -> None: ...
