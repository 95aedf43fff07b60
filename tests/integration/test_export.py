"""Export to a Hugging Face directory: transformers loads it, gives the node's logits, and
generates text with the run's tokenizer."""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.state.checkpoint import Checkpointer
from swarmgrad.node.training.data import (
    TOKENIZER_TENSOR,
    load_corpus,
    tokenizer_tensor,
    train_tokenizer,
)
from swarmgrad.node.training.export import ExportError, export
from swarmgrad.node.training.model import GPT, build_model
from swarmgrad.node.training.step import evaluate
from swarmgrad.simulations.swarm import DEMO_SPEC, SimulationConfig, simulate

SPEC = RunSpec.from_toml(
    '[run]\nid = "export"\n[model]\nvocab_size = 2048\nd_model = 64\nn_layers = 2\nn_heads = 4\n'
    "seq_len = 32\n"
)


def _trained_like(model: GPT) -> GPT:
    """Parameters no initializer would give (biases and gains included)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _node_model(checkpoint: Path, spec: RunSpec) -> GPT:
    """The model a node would run from this checkpoint: the swarm's parameters."""
    model = GPT(spec.model)
    tensors = Checkpointer(checkpoint.parent, spec, keep=1).latest()
    assert tensors is not None
    state = {k.removeprefix("model."): v for k, v in tensors.tensors.items() if "model." in k}
    model.load_state_dict(state)
    return model.eval()


def _hf(out: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(out).eval()


@contextlib.contextmanager
def _transformers_warnings(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail on any warning transformers logs or raises inside (it logs to its own handler)."""
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING, logger="transformers"), warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
    finally:
        transformers.logging.disable_propagation()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("transformers")]
    assert not said, said


def test_transformers_loads_the_export_with_the_same_logits(
    tmp_path: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = _trained_like(build_model(SPEC.model, seed=0)).eval()
    with Checkpointer(tmp_path / "checkpoints", SPEC, keep=1) as checkpoints:
        path = checkpoints.save(
            epoch=3,
            step=30,
            tensors={f"model.{n}": p.detach() for n, p in model.named_parameters()},
            meta={},
        )
    out = tmp_path / "hf"
    assert export(tmp_path / "checkpoints", out, cache_dir=cache_dir) == path  # the newest
    # Every file as readable as the rest (safetensors wrote its own 0600 once).
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {
        name: 0o644
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    }
    # The run's tokenizer has no special token: the config must not claim GPT-2's 50256,
    # which is past this vocabulary's end.
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None,) * 3

    with _transformers_warnings(caplog):
        hf = _hf(out)
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(hf, transformers.GPT2LMHeadModel)
    tokens = torch.randint(0, 2048, (3, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)
    assert json.loads((out / "config.json").read_text())["swarmgrad"]["epoch"] == 3

    # The run's tokenizer comes along, and the model generates text with it.
    ours = load_corpus(SPEC.data, vocab_size=2048, cache_dir=cache_dir).tokenizer
    line = "To be, or not to be, that is the question:"
    assert tokenizer(line)["input_ids"] == ours.encode(line).ids
    assert tokenizer.decode(tokenizer(line)["input_ids"]) == line
    prompt = tokenizer("ROMEO:", return_tensors="pt")
    generated = hf.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 8
    assert isinstance(tokenizer.decode(generated[0]), str)


def test_export_refuses_a_used_folder_and_a_missing_checkpoint(tmp_path: Path) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("")
    with pytest.raises(ExportError, match="not an empty folder"):
        export(tmp_path, used, cache_dir=tmp_path)
    with pytest.raises(ExportError, match="no usable checkpoint"):
        export(tmp_path / "nothing", tmp_path / "out", cache_dir=tmp_path)


def test_an_export_that_cannot_be_written_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    spec = RunSpec.from_toml(
        '[run]\nid = "x"\n[model]\nvocab_size = 300\nd_model = 16\nn_layers = 1\n'
        'n_heads = 2\nseq_len = 8\n[data]\nsource = "files"\npaths = ["unused.txt"]\n'
    )
    tokenizer = train_tokenizer(["alpha beta gamma delta"], 300)
    model = build_model(spec.model, seed=0)
    tensors = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    tensors[TOKENIZER_TENSOR] = tokenizer_tensor(tokenizer)
    with Checkpointer(tmp_path / "ck", spec, keep=1) as checkpoints:
        checkpoints.save(epoch=1, step=1, tensors=tensors, meta={})
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ExportError, match="cannot write"):
        export(tmp_path / "ck", tmp_path / "a-file" / "out", cache_dir=tmp_path)
    # A failure half-way (the disk full, say) leaves no half folder a second try would refuse.
    target = tmp_path / "out"
    real_save = Tokenizer.save

    def full_disk(self: Tokenizer, path: str, pretty: bool = True) -> None:
        raise OSError(28, "No space left on device")

    Tokenizer.save = full_disk  # type: ignore[method-assign]
    try:
        with pytest.raises(ExportError, match="No space left"):
            export(tmp_path / "ck", target, cache_dir=tmp_path)
    finally:
        Tokenizer.save = real_save  # type: ignore[method-assign]
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    export(tmp_path / "ck", target, cache_dir=tmp_path)
    assert (target / "tokenizer.json").is_file()


@pytest.mark.slow
def test_a_trained_swarm_exports_and_transformers_reproduces_its_loss(
    tmp_path: Path, cache_dir: Path
) -> None:
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(DEMO_SPEC.replace("group_size = 256", "group_size = 2"))
    out = tmp_path / "sim"
    summary = simulate(
        SimulationConfig(nodes=2, rounds=2, spec_path=spec_path, profile_path=None, out_dir=out)
    )
    assert summary["replicas_identical"]
    hf_dir = tmp_path / "hf"
    exported = export(out / "checkpoints" / "node-0", hf_dir, cache_dir=cache_dir)
    spec = RunSpec.load(spec_path)
    node_model = _node_model(exported, spec)
    hf = _hf(hf_dir)
    corpus = load_corpus(spec.data, vocab_size=2048, cache_dir=cache_dir)
    windows = corpus.validation(seq_len=64, num_windows=32)
    with torch.no_grad():
        torch.testing.assert_close(hf(windows[:, :-1]).logits, node_model(windows[:, :-1]))
    # The node's own report of its validation loss after the last round, reproduced.
    status = json.loads((out / "node-0.json").read_text())
    node_loss = evaluate(node_model, windows, torch.device("cpu"))
    assert node_loss == pytest.approx(status["val_loss"], abs=1e-4)
    with torch.no_grad():
        shifted = torch.nn.functional.cross_entropy(
            hf(windows[:, :-1]).logits.flatten(0, 1), windows[:, 1:].flatten()
        )
    assert float(shifted) == pytest.approx(node_loss, abs=1e-4)


LLAMA_SPEC = DEMO_SPEC.replace("group_size = 256", "group_size = 2").replace(
    "[model]\nvocab_size = 2048\nd_model = 128\nn_layers = 2\nn_heads = 4\nseq_len = 64\n",
    '[model]\nkind = "hf"\nvocab_size = 2048\nseq_len = 64\n\n[model.config]\n'
    'model_type = "llama"\nhidden_size = 64\nintermediate_size = 128\nnum_hidden_layers = 2\n'
    "num_attention_heads = 4\nnum_key_value_heads = 2\n",
)


def test_a_llama_swarm_trains_and_its_export_reloads_with_the_same_logits(
    tmp_path: Path, cache_dir: Path
) -> None:
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(LLAMA_SPEC)
    spec = RunSpec.load(spec_path)
    assert spec.model.kind == "hf"
    out = tmp_path / "sim"
    summary = simulate(
        SimulationConfig(nodes=2, rounds=3, spec_path=spec_path, profile_path=None, out_dir=out)
    )
    assert summary["ok"]
    assert summary["replicas_identical"]
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5
    hf_dir = tmp_path / "hf"
    exported = export(out / "checkpoints" / "node-1", hf_dir, cache_dir=cache_dir)
    reloaded = _hf(hf_dir)
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    # The node's model from the same checkpoint: the swarm's parameters in our wrapper.
    node_model = build_model(spec.model, seed=99)
    state = Checkpointer(exported.parent, spec, keep=1).latest()
    assert state is not None
    node_model.load_state_dict(
        {k.removeprefix("model."): v for k, v in state.tensors.items() if k.startswith("model.")}
    )
    windows = load_corpus(spec.data, vocab_size=2048, cache_dir=cache_dir).validation(
        seq_len=64, num_windows=8
    )
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(windows[:, :-1]).logits, node_model.eval()(windows[:, :-1])
        )
    status = json.loads((out / "node-1.json").read_text())
    assert evaluate(node_model, windows, torch.device("cpu")) < status["initial_val_loss"]


def test_export_writes_the_tokenizer_the_checkpoint_trained_with(tmp_path: Path) -> None:
    # The shards change after training (more data collected): a BPE trained on them again would
    # differ, and the exported model would read other ids than it learned. The checkpoint keeps
    # its tokenizer; export needs neither the shards nor the cache.
    shard = tmp_path / "shard.txt"
    shard.write_text("\n".join(f"alpha beta gamma {i} delta" for i in range(300)))
    spec = RunSpec.from_toml(
        '[run]\nid = "x"\n[model]\nvocab_size = 300\nd_model = 16\nn_layers = 1\nn_heads = 2\n'
        f'seq_len = 8\n[data]\nsource = "files"\npaths = ["{shard}"]\n'
    )
    trained = load_corpus(spec.data, vocab_size=300, cache_dir=tmp_path / "cache").tokenizer
    model = build_model(spec.model, seed=0)
    tensors = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    with Checkpointer(tmp_path / "ck", spec, keep=1) as checkpoints:
        checkpoints.save(
            epoch=1,
            step=1,
            tensors=tensors | {TOKENIZER_TENSOR: tokenizer_tensor(trained)},
            meta={},
        )
    shard.write_text("\n".join(f"zeta theta omicron {i} kappa" for i in range(300)))
    export(tmp_path / "ck", tmp_path / "out", cache_dir=tmp_path / "other-cache")
    exported = (tmp_path / "out" / "tokenizer.json").read_text()
    assert Tokenizer.from_str(exported).to_str() == trained.to_str()
    assert not (tmp_path / "other-cache").exists()
