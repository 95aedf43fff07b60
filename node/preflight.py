"""What a node checks on its own machine before it touches the network: its ports (gRPC,
metrics), its device, its checkpoint folder (writable, with room for a checkpoint) and its data
shards (every role: a whole-model node, a pipeline stage, a pipeline trainer).

A node that joined the DHT and served gRPC before finding its metrics port taken (or a data
file missing) left a record behind that peers then found dead. Here each such mistake is a
:class:`~swarmgrad.protocol.errors.SetupError` (exit 2) before the first packet.

Probing a port is a bind that is let go at once: something may still take the port before the
node binds it for real, which then fails as before (exit 2 too), only later.
"""

from __future__ import annotations

import errno
import shutil
import socket
import tempfile
from pathlib import Path

from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.training.shards import shard_paths
from swarmgrad.protocol.errors import BindError, SetupError

#: A checkpoint holds weights, outer state and optimizer moments: about 5 fp32 copies.
CHECKPOINT_BYTES_PER_PARAMETER = 4 * 5


def check(
    spec: RunSpec,
    *,
    host: str,
    port: int,
    metrics_address: str,
    device: str = "auto",
    checkpoint_dir: Path | None = None,
) -> None:
    """Every local check, in order; SetupError (saying what to do) for the first that fails."""
    if port:
        _free(host, port, f"cannot listen on {host}:{port}: the port is in use", "--port")
    if metrics_address not in ("off", "auto"):  # auto: 9464, else a free port (metrics.py)
        metrics_host, _, metrics_port = metrics_address.rpartition(":")
        if int(metrics_port):
            _free(
                metrics_host.strip("[]"),
                int(metrics_port),
                f"cannot serve metrics on {metrics_address}: the port is in use",
                "--metrics-address (auto: 9464, else a free port; off)",
            )
    if device == "cuda":
        _cuda()
    if checkpoint_dir is not None:
        _writable(checkpoint_dir)
        _room(checkpoint_dir, checkpoint_bytes(spec))
    if spec.data.source == "files":
        shard_paths(spec.data)  # DataError: a missing file, a pattern that matches nothing


def _cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SetupError(
            f"--device cuda: torch {torch.__version__} sees no CUDA device (install a CUDA "
            f"build of torch, docs/gpu.md, or use --device cpu or auto)"
        )


def _writable(folder: Path) -> None:
    """The checkpoint folder exists (made if not) and takes a file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".preflight-"):
            pass
    except OSError as error:
        raise SetupError(
            f"cannot write checkpoints to {folder}: {error.strerror or error} (choose another "
            f"--checkpoint-dir, or free or fix that folder)"
        ) from None


def checkpoint_bytes(spec: RunSpec) -> int:
    """About what one checkpoint of ``spec``'s model takes on disk (a pipeline stage's: the
    model's share of one stage, the largest stage being about that)."""
    from swarmgrad.node.training.model import parameter_count

    return parameter_count(spec.model) * CHECKPOINT_BYTES_PER_PARAMETER // spec.pipeline.stages


def _room(folder: Path, need: int) -> None:
    """Room for the next checkpoint (written beside the last before that one goes): a node
    that cannot write one would train on and lose its work at the next crash."""
    free = shutil.disk_usage(folder).free
    if free < need:
        raise SetupError(
            f"no room for a checkpoint in {folder}: one takes ~{need / 2**20:.0f} MiB and "
            f"{free / 2**20:.1f} MiB are free (free some space, or choose another "
            f"--checkpoint-dir; swarmgrad doctor says what the run needs)"
        )


def _free(host: str, port: int, message: str, option: str) -> None:
    if in_use(host, port):
        raise BindError(f"{message} (another process listens there; choose another {option})")


def in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails because the port is taken (other errors, such as an
    address this machine does not have, are left to the real bind, which says so)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise SetupError(f"cannot resolve {host!r}: {error}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # As servers do: a port a closed connection left in TIME_WAIT is free to listen on.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False
