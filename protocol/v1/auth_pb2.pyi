from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Auth(_message.Message):
    __slots__ = ("public_key", "issued_at", "nonce", "signature")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    issued_at: float
    nonce: bytes
    signature: bytes
    def __init__(self, public_key: _Optional[bytes] = ..., issued_at: _Optional[float] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...
