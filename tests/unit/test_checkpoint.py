"""Checkpoints on disk (no sockets): what is saved comes back exactly, and a checkpoint that is
damaged, half-written or of another run is reported and skipped, never loaded."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarmgrad.compression import get_codec
from swarmgrad.node.runspec import ModelSection, RunSpec
from swarmgrad.node.state import checkpoint as checkpoint_module
from swarmgrad.node.state.checkpoint import (
    MANIFEST_FILE,
    ROUND_FILE,
    STATE_FILE,
    Checkpointer,
    CheckpointError,
    load_optimizer_state,
    optimizer_state,
    spec_hash_of,
)
from swarmgrad.node.training.api import DiLoCo, SyncDataParallel
from swarmgrad.node.training.model import build_model
from swarmgrad.protocol.state import Snapshot

SPEC = RunSpec.from_toml('[run]\nid = "r"\n')


def _save(checkpoints: Checkpointer, epoch: int, value: float = 0.0) -> Path:
    return checkpoints.save(
        epoch=epoch,
        step=10 * epoch,
        tensors={"w": torch.full((64,), value), "step": torch.tensor(float(epoch))},
        meta={"cursor": epoch},
    )


def test_a_checkpoint_comes_back_exactly_and_only_the_newest_are_kept(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, SPEC, keep=2) as checkpoints:
        for epoch in range(1, 5):
            _save(checkpoints, epoch, value=epoch / 3)
        assert [p.name for p in checkpoints.candidates()] == [
            "epoch-000004-step-000000040",
            "epoch-000003-step-000000030",
        ]
        latest = checkpoints.latest()
    assert latest is not None
    assert (latest.epoch, latest.step, latest.meta) == (4, 40, {"cursor": 4})
    assert torch.equal(latest.tensors["w"], torch.full((64,), 4 / 3))
    manifest = json.loads((latest.path / MANIFEST_FILE).read_text())
    assert manifest["spec_hash"] == SPEC.hash.hex()
    assert len(manifest["files"][STATE_FILE]["sha256"]) == 64


def test_damaged_and_foreign_checkpoints_are_reported_and_skipped(tmp_path: Path) -> None:
    other = RunSpec.from_toml('[run]\nid = "r"\n[algorithm]\nouter_lr = 0.5\n')
    with Checkpointer(tmp_path, other, keep=10) as foreign:
        _save(foreign, 9)  # newest of all, but another run spec's
    with Checkpointer(tmp_path, SPEC, keep=10) as checkpoints:
        good = _save(checkpoints, 1, value=1.0)
        flipped = _save(checkpoints, 2)
        truncated = _save(checkpoints, 3)
        no_manifest = _save(checkpoints, 4)
        data = bytearray((flipped / STATE_FILE).read_bytes())
        data[-1] ^= 0xFF  # one bit of one value
        (flipped / STATE_FILE).write_bytes(bytes(data))
        (truncated / STATE_FILE).write_bytes((truncated / STATE_FILE).read_bytes()[:100])
        (no_manifest / MANIFEST_FILE).unlink()
        latest = checkpoints.latest()
        rejected = checkpoints.rejected
    assert latest is not None
    assert latest.path == good
    assert torch.equal(latest.tensors["w"], torch.ones(64))
    assert len(rejected) == 4
    assert "another run spec" in rejected[0]
    assert "algorithm.outer_lr: here 0.7, there 0.5" in rejected[0]
    assert "no readable manifest" in rejected[1]
    assert "does not match its sha256" in rejected[2]
    assert "does not match its sha256" in rejected[3]


def test_an_interrupted_write_leaves_nothing_that_loads_and_is_cleaned_up(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, SPEC, keep=3) as checkpoints:
        _save(checkpoints, 1)
    # What a kill -9 mid-write leaves: a temp directory with part of a checkpoint in it.
    leftover = tmp_path / ".tmp-epoch-000002-step-000000020-999"
    leftover.mkdir()
    (leftover / STATE_FILE).write_bytes(b"\0" * 10)
    with Checkpointer(tmp_path, SPEC, keep=3) as checkpoints:
        assert not leftover.exists()
        latest = checkpoints.latest()
        assert latest is not None
        assert latest.epoch == 1
        assert checkpoints.rejected == []


def test_the_round_started_after_a_checkpoint_is_noted_beside_it(tmp_path: Path) -> None:
    """A node notes each round it starts; a restart asks whether one started at or after its
    checkpoint (its training may then be in the swarm's state already)."""
    other = RunSpec.from_toml('[run]\nid = "r"\n[algorithm]\nouter_lr = 0.5\n')
    with Checkpointer(tmp_path, SPEC, keep=3) as checkpoints:
        _save(checkpoints, 2)  # epoch 2, step 20
        latest = checkpoints.latest()
        assert latest is not None
        assert not checkpoints.round_after(latest)  # no note yet
        checkpoints.note_round(epoch=1, step=15)  # a round before it
        assert not checkpoints.round_after(latest)
        checkpoints.note_round(epoch=2, step=20)  # stopped in a round at its very step
        assert checkpoints.round_after(latest)
        checkpoints.note_round(epoch=3, step=31)  # a later round started
        assert checkpoints.round_after(latest)
    with Checkpointer(tmp_path, other, keep=3) as others:
        assert not others.round_after(latest)  # another spec's note says nothing of it
    # A note cut short (it is written by a rename, so only by hand) is read the safe way:
    # the training is not sent twice.
    (tmp_path / ROUND_FILE).write_text('{"epoch": 2')
    leftover = tmp_path / f".tmp-{ROUND_FILE}-999"
    leftover.write_text("{")
    with Checkpointer(tmp_path, SPEC, keep=3) as checkpoints:
        assert not leftover.exists()  # cleaned up like a checkpoint's temp folder
        assert checkpoints.round_after(latest)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_another_specs_checkpoints_never_push_out_this_runs_own(tmp_path: Path) -> None:
    # The run id's folder still holds an earlier spec's newest checkpoints (an edited outer_lr).
    earlier = RunSpec.from_toml('[run]\nid = "r"\n[algorithm]\nouter_lr = 0.5\n')
    with Checkpointer(tmp_path, earlier, keep=2) as old_run:
        for epoch in range(1, 6):
            _save(old_run, epoch, value=-1.0)
    with Checkpointer(tmp_path, SPEC, keep=2) as checkpoints:
        assert checkpoints.latest() is None  # both of the earlier spec's are refused
        for epoch in range(1, 5):
            _save(checkpoints, epoch, value=float(epoch))
            latest = checkpoints.latest()
            assert latest is not None
            assert latest.epoch == epoch, f"the save of epoch {epoch} did not stay"
        # At the step where the earlier spec has one, this run's replaces it (and stays).
        _save(checkpoints, 5, value=5.0)
        latest = checkpoints.latest()
    assert latest is not None
    assert latest.epoch == 5
    assert torch.equal(latest.tensors["w"], torch.full((64,), 5.0))
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    # keep=2 of this run's; the earlier spec's two were replaced where this run reached them.
    assert names == [f"epoch-00000{e}-step-0000000{e}0" for e in (4, 5)]
    assert {spec_hash_of(tmp_path / name) for name in names} == {SPEC.hash.hex()}


def test_a_damaged_newest_checkpoint_is_replaced_when_the_run_gets_there_again(
    tmp_path: Path,
) -> None:
    with Checkpointer(tmp_path, SPEC, keep=3) as checkpoints:
        paths = [_save(checkpoints, epoch, value=float(epoch)) for epoch in range(1, 6)]
    for damaged in paths[3:]:  # epochs 4 and 5: torn writes
        (damaged / STATE_FILE).write_bytes((damaged / STATE_FILE).read_bytes()[:50])
    with Checkpointer(tmp_path, SPEC, keep=3) as checkpoints:
        resumed = checkpoints.latest()
        assert resumed is not None
        assert resumed.epoch == 3
        for epoch in (4, 5, 6):  # the resumed run saves at the steps it reaches again
            _save(checkpoints, epoch, value=10.0 + epoch)
            latest = checkpoints.latest()
            assert latest is not None
            assert latest.epoch == epoch
            assert torch.equal(latest.tensors["w"], torch.full((64,), 10.0 + epoch))
        kept = [p.name[:12] for p in checkpoints.candidates()]
    assert kept == ["epoch-000006", "epoch-000005", "epoch-000004"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("files", {STATE_FILE: None}), ("files", {STATE_FILE: "x"}), ("epoch", float("inf"))],
)
def test_a_manifest_of_the_wrong_types_is_skipped(tmp_path: Path, field: str, value: Any) -> None:
    with Checkpointer(tmp_path, SPEC, keep=3) as checkpoints:
        _save(checkpoints, 1)
        newest = _save(checkpoints, 2)
        manifest = json.loads((newest / MANIFEST_FILE).read_text())
        manifest[field] = value
        (newest / MANIFEST_FILE).write_text(json.dumps(manifest))  # inf: JSON's Infinity
        latest = checkpoints.latest()
    assert latest is not None
    assert latest.epoch == 1
    assert len(checkpoints.rejected) == 1


def test_a_kill_while_an_old_checkpoint_is_deleted_leaves_no_half_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Checkpointer(tmp_path, SPEC, keep=1) as checkpoints:
        _save(checkpoints, 1)
        rmtree = checkpoint_module.shutil.rmtree

        def die_after_one_file(path: Path, ignore_errors: bool = False) -> None:
            if not Path(path).name.startswith(".tmp-retired-"):
                return rmtree(path, ignore_errors=ignore_errors)
            (Path(path) / STATE_FILE).unlink()
            raise SystemExit("killed")  # what is on disk now is what a kill -9 leaves

        monkeypatch.setattr(checkpoint_module.shutil, "rmtree", die_after_one_file)
        with pytest.raises(SystemExit):
            _save(checkpoints, 2)
    monkeypatch.undo()
    with Checkpointer(tmp_path, SPEC, keep=1) as checkpoints:
        latest = checkpoints.latest()
        assert [p.name[:12] for p in checkpoints.candidates()] == ["epoch-000002"]
    assert latest is not None
    assert (latest.epoch, checkpoints.rejected) == (2, [])
    assert not list(tmp_path.glob(".tmp-*"))  # the half-deleted one, gone at the next start


def test_a_checkpoint_that_cannot_be_written_is_an_error_that_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Checkpointer(tmp_path, SPEC, keep=3) as checkpoints:
        _save(checkpoints, 1, value=1.0)

        def full(tensors: Any, path: Path, metadata: Any) -> None:
            Path(path).write_bytes(b"\0" * 100)  # what fitted before the disk was full
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(checkpoint_module, "save_file", full)
        with pytest.raises(CheckpointError, match=r"not written.*No space left"):
            _save(checkpoints, 2)
        monkeypatch.undo()
        assert not list(tmp_path.glob(".tmp-*"))
        latest = checkpoints.latest()
        assert latest is not None
        assert latest.epoch == 1
        _save(checkpoints, 3)  # space again: the next save goes through
        assert [p.name[:12] for p in checkpoints.candidates()] == ["epoch-000003", "epoch-000001"]


def test_two_nodes_cannot_share_a_checkpoint_folder(tmp_path: Path) -> None:
    with (
        Checkpointer(tmp_path, SPEC, keep=1),
        pytest.raises(CheckpointError, match="in use by another node"),
        Checkpointer(tmp_path, SPEC, keep=1),
    ):
        pass
    with Checkpointer(tmp_path, SPEC, keep=1):  # released on exit
        pass


def test_the_optimizer_state_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    tensors, meta = optimizer_state(optimizer)
    with Checkpointer(tmp_path, SPEC, keep=1) as checkpoints:
        checkpoints.save(epoch=0, step=3, tensors=tensors, meta={"optimizer": meta})
        restored = checkpoints.latest()
    assert restored is not None
    twin = torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1.0)  # the saved lr must win
    meta = json.loads(json.dumps(restored.meta))  # as read back from the manifest
    load_optimizer_state(twin_optimizer, restored.tensors, meta["optimizer"])
    batch = torch.randn(5, 8)
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        m(batch).square().mean().backward()
        o.step()
    assert torch.equal(model.weight, twin.weight)


def _fake_swarm(codec: str = "int8") -> Any:
    published: list[Any] = []
    return SimpleNamespace(
        codec=get_codec(codec),
        codec_is_lossless=False,
        owner_feedback=get_codec(codec).traits.owner_feedback,
        peer_id="me",
        spec=SimpleNamespace(averaging=SimpleNamespace(chunk_values=1024, group_size=2)),
        publish=lambda snapshot, throughput: published.append(snapshot),
        published=published,
    )


def test_replica_state_round_trips_mid_round() -> None:
    config = ModelSection(vocab_size=64, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    model = build_model(config, seed=0)
    diloco = DiLoCo(_fake_swarm(), model, inner_steps=5, outer_lr=0.7, outer_momentum=0.9)
    with torch.no_grad():
        for p in model.parameters():  # as if some inner steps had run
            p.add_(torch.randn_like(p))
    diloco._residual = torch.randn(diloco.numel)
    diloco.outer.momentum_buffer = torch.randn(diloco.numel)
    for _ in range(3):
        diloco.step(samples=16)
    tensors, meta = diloco.state_dict()

    twin_model = build_model(config, seed=1)
    swarm = _fake_swarm()
    twin = DiLoCo(swarm, twin_model, inner_steps=5, outer_lr=0.7, outer_momentum=0.9)
    twin.load_state_dict(tensors, json.loads(json.dumps(meta)))
    assert torch.equal(twin.state_vector(), diloco.state_vector())  # what the swarm shares
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b)  # this replica's own, mid-round
    assert torch.equal(twin._residual, diloco._residual)
    assert (twin._steps, twin.samples, twin.epoch) == (3, 48, 0)
    served = Snapshot.of(0, diloco.state_vector())
    assert swarm.published[-1].checksum == served.checksum  # published at once
    with pytest.raises(ValueError, match="residual"):
        twin.load_state_dict({"residual": torch.zeros(3)}, meta)


def test_an_owners_residual_is_checkpointed() -> None:
    """With a codec whose owners keep feedback (``sparse``), what an owner's results dropped is
    training state: it survives a restart, a checkpoint without one (another codec's) restores
    as zeros, and a wrong size is refused."""
    config = ModelSection(vocab_size=64, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    diloco = DiLoCo(_fake_swarm("sparse"), build_model(config, seed=0), inner_steps=5,
                    outer_lr=1.0, outer_momentum=0.0)  # fmt: skip
    assert diloco._owner_residual is not None
    diloco._owner_residual.copy_(torch.randn(diloco.numel))
    tensors, meta = diloco.state_dict()
    twin = DiLoCo(_fake_swarm("sparse"), build_model(config, seed=1), inner_steps=5,
                  outer_lr=1.0, outer_momentum=0.0)  # fmt: skip
    twin.load_state_dict(tensors, json.loads(json.dumps(meta)))
    assert twin._owner_residual is not None
    assert torch.equal(twin._owner_residual, diloco._owner_residual)
    twin.load_state_dict({k: v for k, v in tensors.items() if k != "owner_residual"}, meta)
    assert not twin._owner_residual.any()
    with pytest.raises(ValueError, match="owner residual"):
        twin.load_state_dict(tensors | {"owner_residual": torch.zeros(3)}, meta)
    int8 = DiLoCo(_fake_swarm(), build_model(config, seed=1), inner_steps=5, outer_lr=1.0,
                  outer_momentum=0.0)  # fmt: skip
    assert "owner_residual" not in int8.state_dict()[0]
    int8.load_state_dict(tensors, meta)  # a sparse run's checkpoint: its owner residual unused


def test_sync_replica_keeps_gradients_accumulated_toward_the_next_step() -> None:
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = SyncDataParallel(_fake_swarm(), model, optimizer, target_batch_size=64)
    model(torch.randn(4, 6)).sum().backward()
    assert sync.step(samples=16) is None  # 16 of the 32 this replica brings to a step
    tensors, meta = sync.state_dict()
    twin_model = torch.nn.Linear(6, 3)
    twin = SyncDataParallel(
        _fake_swarm(), twin_model, torch.optim.AdamW(twin_model.parameters()), target_batch_size=64
    )
    twin.load_state_dict(tensors, meta)
    assert twin_model.weight.grad is not None
    assert model.weight.grad is not None
    assert torch.equal(twin_model.weight.grad, model.weight.grad)
    assert torch.equal(twin_model.weight, model.weight)
    assert (twin.samples, twin._micro_batches) == (16, 1)


def test_a_run_started_from_init_weights_reads_its_own_checkpoints(tmp_path: Path) -> None:
    """The manifest keeps the spec with its local paths (model.init), so it parses back; the
    hash alone leaves them out. (A manifest of the canonical form did not parse: every restart
    of such a run rejected its own checkpoints.)"""
    from swarmgrad.node.training.model import save_weights

    section = ModelSection(vocab_size=64, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    digest = save_weights(build_model(section, seed=1), tmp_path / "init.safetensors")
    spec = RunSpec.from_toml(
        f'[run]\nid = "r"\n[model]\nvocab_size = 64\nd_model = 16\nn_layers = 1\nn_heads = 2\n'
        f'seq_len = 8\ninit = "{tmp_path}/init.safetensors"\ninit_sha256 = "{digest}"\n'
    )
    with Checkpointer(tmp_path / "checkpoints", spec, keep=2) as checkpoints:
        checkpoints.save(epoch=1, step=10, tensors={"x": torch.ones(3)}, meta={})
        latest = checkpoints.latest()
        assert latest is not None
        assert (latest.epoch, latest.spec.hash) == (1, spec.hash)
        assert not checkpoints.rejected
