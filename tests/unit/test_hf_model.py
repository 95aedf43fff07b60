"""``[model] kind = "hf"``: a transformers architecture from the run spec, seeded like the GPT,
checked like any spec key; GPT runs keep their spec hash."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from swarmgrad.node.runspec import RunSpec, RunSpecError
from swarmgrad.node.training.hf import HFCausalLM, HFModelError
from swarmgrad.node.training.model import build_model, save_weights, skeleton

LLAMA = """
[run]
id = "hf"
[model]
kind = "hf"
vocab_size = 512
seq_len = 32
[model.config]
model_type = "llama"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
"""


def test_a_llama_config_builds_the_same_model_on_every_peer_and_trains() -> None:
    spec = RunSpec.from_toml(LLAMA)
    a, b, other = (build_model(spec.model, seed=s) for s in (0, 0, 1))
    assert isinstance(a, HFCausalLM)
    assert type(a.hf).__name__ == "LlamaForCausalLM"
    assert a.hf.config.vocab_size == 512
    assert a.hf.config.max_position_embeddings == 32
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(
        torch.equal(x, y) for x, y in zip(a.parameters(), other.parameters(), strict=True)
    )
    meta = skeleton(spec.model)
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [
        (n, p.shape) for n, p in a.named_parameters()
    ]
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(a.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = a.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert a(tokens[:, :-1]).shape == (4, 32, 512)
    assert losses[-1] < losses[0] - 0.5


def test_init_weights_of_an_hf_model_are_checked_and_loaded(tmp_path: Path) -> None:
    spec = RunSpec.from_toml(LLAMA)
    trained = build_model(spec.model, seed=5)
    digest = save_weights(trained, tmp_path / "init.safetensors")
    assert digest == hashlib.sha256((tmp_path / "init.safetensors").read_bytes()).hexdigest()
    pinned = RunSpec.from_toml(
        LLAMA.replace(
            "seq_len = 32",
            f'seq_len = 32\ninit = "{tmp_path}/init.safetensors"\ninit_sha256 = "{digest}"',
        )
    )
    loaded = build_model(pinned.model, seed=0)
    assert all(
        torch.equal(x, y) for x, y in zip(loaded.parameters(), trained.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('model_type = "llama"', "", "model.config.model_type must be one of"),
        ('model_type = "llama"', 'model_type = "bert"', "model.config.model_type must be one of"),
        ("hidden_size = 32", "vocab_size = 100", "model.config.vocab_size: set model.vocab_size"),
        ("hidden_size = 32", "nope = {a = 1}", "model.config.nope must be a number"),
        ('kind = "hf"', 'kind = "onnx"', "model.kind must be one of gpt, hf"),
    ],
)
def test_bad_hf_sections_are_refused_with_the_key_named(old: str, new: str, message: str) -> None:
    with pytest.raises(RunSpecError, match=message):
        RunSpec.from_toml(LLAMA.replace(old, new))


def test_a_config_key_transformers_does_not_know_is_refused_when_built() -> None:
    spec = RunSpec.from_toml(LLAMA.replace("hidden_size = 32", "hidden_size = 32\nhiden = 3"))
    with pytest.raises(HFModelError, match="hiden not in transformers' LlamaConfig"):
        build_model(spec.model, seed=0)


def test_gpt_runs_keep_their_hash_and_hf_runs_hash_their_config() -> None:
    gpt = RunSpec.from_toml('[run]\nid = "x"\n')
    assert b'"kind"' not in gpt.canonical()
    assert b'"config"' not in gpt.canonical()
    with pytest.raises(RunSpecError, match=r"\[model.config\] is for kind = \"hf\""):
        RunSpec.from_toml('[run]\nid = "x"\n[model.config]\nmodel_type = "llama"\n')
    llama = RunSpec.from_toml(LLAMA)
    wider = RunSpec.from_toml(LLAMA.replace("intermediate_size = 64", "intermediate_size = 96"))
    assert llama.hash != wider.hash
    assert "model.config" in "; ".join(llama.differences(wider.canonical()))
