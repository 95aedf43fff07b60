"""The wire schema: committed stubs match the .proto files, and tensor messages round-trip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarmgrad.compression import CodecError, get_codec
from swarmgrad.protocol.tensors import meta_from_proto, tensor_from_proto, tensor_to_proto
from swarmgrad.protocol.v1 import peer_pb2, peer_pb2_grpc, tensor_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_proto_files() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_stale_check_notices_a_changed_proto(tmp_path: Path) -> None:
    # Run the checker on a copy of the repo's protocol folder with one field added.
    scripts, protocol = tmp_path / "scripts", tmp_path / "protocol"
    scripts.mkdir()
    (scripts / "gen_protos.py").write_text((ROOT / "scripts" / "gen_protos.py").read_text())
    (protocol / "v1").mkdir(parents=True)
    for path in (ROOT / "protocol" / "v1").iterdir():
        if path.is_file():
            (protocol / "v1" / path.name).write_bytes(path.read_bytes())
    proto = protocol / "v1" / "peer.proto"
    proto.write_text(proto.read_text().replace("uint32 protocol_version = 1;", "uint32 pv = 1;"))
    result = subprocess.run(
        [sys.executable, str(scripts / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "peer_pb2.py" in result.stdout


def test_generated_modules_live_under_the_swarmgrad_namespace() -> None:
    assert peer_pb2.DESCRIPTOR.package == "swarmgrad.v1"
    assert peer_pb2_grpc.__name__ == "swarmgrad.protocol.v1.peer_pb2_grpc"
    assert hasattr(peer_pb2_grpc, "PeerServicer")


@pytest.mark.parametrize("name", ["int8", "topk", "powersgd", "bf16"])
def test_encoded_tensor_survives_serialization(name: str) -> None:
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    data, meta = get_codec(name).encode(x)
    wire = tensor_to_proto(data, meta).SerializeToString()
    message = tensor_pb2.EncodedTensor.FromString(wire)
    assert meta_from_proto(message.meta) == meta
    from swarmgrad.compression import decode

    assert torch.equal(tensor_from_proto(message), decode(data, meta))


def test_hostile_wire_metadata_is_rejected_before_decoding() -> None:
    data, meta = get_codec("int8").encode(torch.randn(100))
    message = tensor_to_proto(data, meta)
    message.meta.shape.extend([1] * 20)
    with pytest.raises(CodecError, match="dimensions"):
        tensor_from_proto(message)
    message = tensor_to_proto(data, meta)
    message.meta.codec = "x" * 1000
    with pytest.raises(CodecError, match="longer than"):
        tensor_from_proto(message)
    with pytest.raises(CodecError, match="no meta"):
        tensor_from_proto(tensor_pb2.EncodedTensor(payload=data))
    message = tensor_to_proto(data, meta)
    with pytest.raises(CodecError, match="more than 50"):
        tensor_from_proto(message, max_numel=50)
