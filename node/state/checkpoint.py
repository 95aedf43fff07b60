"""Checkpoints: a node's whole training state on disk, never left half-written.

One checkpoint is one directory, ``epoch-000012-step-000000650/``, holding ``state.safetensors``
(every tensor: parameters, optimizer states, error-feedback residuals, RNG state) and
``manifest.json`` (format, run id, spec hash and the spec, epoch, step, the sha256 and
size of each file, and small JSON metadata such as the data cursor). A checkpoint is written into
a ``.tmp-*`` directory, each file and the directory are fsynced, then the directory is renamed into
place and its parent fsynced: a kill at any moment leaves either the whole checkpoint or a temp
directory that the next start deletes. The newest ``keep`` checkpoints of this run spec are
kept, the one just written always among them; an old one is renamed to a ``.tmp-*`` name before it
is deleted, so a kill mid-delete leaves nothing half-gone under a checkpoint's name. Checkpoints of
another spec (a run id's earlier spec sharing its folder) and ones found damaged are left alone and
not counted: they never push this run's own checkpoints out.

Reading goes newest first and takes the first checkpoint that is whole and ours: a manifest that
does not parse, a spec hash that is not this run's, a file whose sha256 differs, a safetensors file
that does not open: each is reported (:attr:`Checkpointer.rejected`) and skipped, never loaded.
A lock file keeps two nodes from sharing one directory.

Beside the checkpoints, ``round.json`` notes the round this node started after its last
mid-round checkpoint (its epoch and step, before any of its values leave; the trainer decides
when): a node killed during that round may have delivered some of the training the checkpoint
holds, so a restart from a checkpoint at that step or before it knows that training may be in
the swarm's state already (:meth:`Checkpointer.round_after`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from swarmgrad.node.runspec import RunSpec, RunSpecError
from swarmgrad.protocol.errors import SetupError

log = logging.getLogger(__name__)

FORMAT = 1
STATE_FILE, MANIFEST_FILE, LOCK_FILE = "state.safetensors", "manifest.json", ".lock"
ROUND_FILE = "round.json"
_NAME = re.compile(r"^epoch-(\d{6,})-step-(\d{9,})$")


class CheckpointError(SetupError):
    """A checkpoint cannot be used (the message says which and why), or the folder is locked."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    spec: RunSpec
    epoch: int
    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: Path, *, spec: RunSpec | None = None) -> Checkpoint:
    """The checkpoint in directory ``path``, checked whole; CheckpointError says what is wrong.

    With ``spec``, a checkpoint of another run spec is refused too.
    """
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: no readable manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a swarmgrad checkpoint (format {FORMAT})")
    try:
        theirs = RunSpec.from_dict(json.loads(manifest["spec"]))
        epoch, step, files = int(manifest["epoch"]), int(manifest["step"]), manifest["files"]
        meta = dict(manifest.get("meta", {}))
    except (KeyError, TypeError, ValueError, OverflowError, RunSpecError) as error:
        raise CheckpointError(f"{path}: malformed manifest ({error})") from None
    if spec is not None and theirs.hash != spec.hash:
        differences = "; ".join(spec.differences(theirs.canonical())) or "unknown fields"
        raise CheckpointError(
            f"{path}: belongs to another run spec ({theirs.run.id} {theirs.short_hash}, this "
            f"node runs {spec.run.id} {spec.short_hash}): {differences}"
        )
    if (
        not isinstance(files, dict)
        or set(files) != {STATE_FILE}
        or not all(isinstance(entry, dict) for entry in files.values())
    ):
        raise CheckpointError(f"{path}: the manifest must list exactly {STATE_FILE}")
    for name, expected in files.items():
        file = path / name
        try:
            size = file.stat().st_size
        except OSError:
            raise CheckpointError(f"{path}: {name} is missing") from None
        if size != expected.get("bytes") or _sha256(file) != expected.get("sha256"):
            raise CheckpointError(f"{path}: {name} does not match its sha256 in the manifest")
    try:
        tensors = load_file(path / STATE_FILE)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path}: {STATE_FILE} does not load ({error})") from None
    return Checkpoint(path=path, spec=theirs, epoch=epoch, step=step, tensors=tensors, meta=meta)


def spec_hash_of(path: Path) -> str | None:
    """The spec hash a checkpoint's manifest names (hex), unchecked; None if it names none."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    named = manifest.get("spec_hash") if isinstance(manifest, dict) else None
    return named if isinstance(named, str) else None


def candidates(folder: Path) -> list[Path]:
    """The checkpoint directories in ``folder``, newest (epoch, step) first (unchecked)."""
    found = []
    for path in folder.iterdir() if folder.is_dir() else ():
        match = _NAME.match(path.name)
        if match and path.is_dir():
            found.append(((int(match[1]), int(match[2])), path))
    return [path for _, path in sorted(found, reverse=True)]


class Checkpointer:
    """Saves and finds the checkpoints of one node in ``folder`` (locked while open)."""

    def __init__(self, folder: Path, spec: RunSpec, *, keep: int) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.folder, self.spec, self.keep = folder, spec, keep
        #: Checkpoints found unusable, with why, in the order met.
        self.rejected: list[str] = []
        self._unusable: set[Path] = set()
        self._lock: int | None = None

    def __enter__(self) -> Checkpointer:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(
                f"{self.folder} is in use by another node; give each node its own "
                f"--checkpoint-dir (or SWARMGRAD_HOME)"
            ) from None
        self._lock = fd
        self._remove_temporaries()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    def _remove_temporaries(self) -> None:
        for leftover in self.folder.glob(".tmp-*"):
            log.info("removing %s, left by an interrupted checkpoint", leftover)
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)

    def candidates(self) -> list[Path]:
        """Checkpoint directories, newest (epoch, step) first."""
        return candidates(self.folder)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that is whole and of this run spec; the others are reported."""
        for path in self.candidates():
            try:
                return read(path, spec=self.spec)
            except CheckpointError as error:
                self.rejected.append(str(error))
                self._unusable.add(path)
                log.warning("skipping checkpoint: %s", error)
        return None

    def note_round(self, *, epoch: int, step: int) -> None:
        """Note that this node starts its round of ``epoch`` at ``step`` (written whole, by a
        rename, before the round sends anything). A note that cannot be written is logged: a
        restart then cannot tell whether its checkpoint's training went out in that round."""
        note = {"spec_hash": self.spec.hash.hex(), "epoch": epoch, "step": step}
        temporary = self.folder / f".tmp-{ROUND_FILE}-{os.getpid()}"
        try:
            with temporary.open("w") as out:
                json.dump(note, out)
                out.flush()
                os.fsync(out.fileno())
            temporary.replace(self.folder / ROUND_FILE)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            log.warning("could not note the round it starts (%s)", error)

    def round_after(self, checkpoint: Checkpoint) -> bool:
        """Whether this node started a round at or after ``checkpoint``'s step (its note says
        so): that round may have carried the training the checkpoint holds to the swarm."""
        try:
            note = json.loads((self.folder / ROUND_FILE).read_text())
            spec_hash, epoch, step = note["spec_hash"], int(note["epoch"]), int(note["step"])
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("%s unreadable (%s): read as a round after it", ROUND_FILE, error)
            return True  # the safe reading: the training is not sent twice
        return (
            spec_hash == self.spec.hash.hex()
            and epoch >= checkpoint.epoch
            and step >= checkpoint.step
        )

    def save(
        self, *, epoch: int, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> Path:
        """Write one checkpoint atomically, then drop all but the newest ``keep``;
        CheckpointError if it cannot be written (the checkpoints before it stand)."""
        if self._lock is None:
            raise RuntimeError("use the Checkpointer as a context manager")
        name = f"epoch-{epoch:06d}-step-{step:09d}"
        final = self.folder / name
        temporary = self.folder / f".tmp-{name}-{os.getpid()}"
        try:
            return self._write(final, temporary, epoch, step, tensors, meta)
        except (OSError, SafetensorError) as error:  # a full disk, a folder gone read-only
            shutil.rmtree(temporary, ignore_errors=True)  # nothing half-written left to fill it
            raise CheckpointError(f"{final}: not written ({error})") from None

    def _write(
        self,
        final: Path,
        temporary: Path,
        epoch: int,
        step: int,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
    ) -> Path:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        state = temporary / STATE_FILE
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
            state,
            metadata={"format": str(FORMAT)},
        )
        _fsync(state)
        manifest = {
            "format": FORMAT,
            "run_id": self.spec.run.id,
            "spec_hash": self.spec.hash.hex(),
            "spec": self.spec.document().decode(),  # paths too: model.init, data.tokenizer
            "epoch": epoch,
            "step": step,
            "created_at": time.time(),
            "files": {STATE_FILE: {"sha256": _sha256(state), "bytes": state.stat().st_size}},
            "meta": meta,
        }
        with (temporary / MANIFEST_FILE).open("w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(temporary)
        if final.exists() and self._usable(final):
            shutil.rmtree(temporary)  # saved twice at one step (a stop right after a round)
            return final
        if final.exists():  # damaged or another spec's, at the step this run has just reached
            log.warning("replacing %s (damaged, or another run spec's) with this run's", final)
            self._discard(final)
        temporary.rename(final)
        _fsync(self.folder)
        self._unusable.discard(final)  # what was found there before is gone
        try:
            self._retire(final)
        except OSError as error:  # the new checkpoint stands; the old ones wait for the next save
            log.warning("old checkpoints not deleted: %s", error)
        return final

    def _usable(self, path: Path) -> bool:
        try:
            read(path, spec=self.spec)
        except CheckpointError:
            return False
        return True

    def _retire(self, kept: Path) -> None:
        """Delete this spec's checkpoints beyond the newest ``keep`` (``kept`` always counted
        among them), leaving another spec's and damaged ones alone."""
        ours = self.spec.hash.hex()
        others = [
            path
            for path in self.candidates()
            if path != kept and path not in self._unusable and spec_hash_of(path) == ours
        ]
        for old in others[self.keep - 1 :]:
            self._discard(old)

    def _discard(self, path: Path) -> None:
        """Delete a checkpoint: first out of its name (one rename), then its files."""
        doomed = self.folder / f".tmp-retired-{path.name}-{os.getpid()}"
        path.rename(doomed)
        _fsync(self.folder)
        shutil.rmtree(doomed, ignore_errors=True)


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], Any]:
    """An optimizer's state as tensors (``optimizer.<param>.<key>``) and JSON-able metadata."""
    state_dict = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, values in state_dict["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: Any
) -> None:
    """Inverse of :func:`optimizer_state`."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            index, key = name.removeprefix("optimizer.").split(".", 1)
            state.setdefault(int(index), {})[key] = value
    for name, value in meta["scalars"].items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
