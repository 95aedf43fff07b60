"""``swarmgrad export``: a checkpoint's model as a Hugging Face directory for ``transformers``.

A ``kind = "hf"`` model is written by transformers itself (``save_pretrained``). The run's GPT
(``model.py``) is GPT-2's architecture with exact GELU: learned positions, pre-norm blocks, fused
q/k/v, tied embeddings. So its export is a GPT-2 directory: ``config.json``
(``GPT2LMHeadModel``), ``model.safetensors`` with GPT-2's parameter names (its ``Conv1D`` weights
are stored ``[in, out]``, the transpose of ``nn.Linear``'s). Either way the tokenizer the replica
trained with comes along (``tokenizer.json`` and its config), from the checkpoint itself. The
swarm's parameters are exported (``model.<name>`` in the checkpoint), not a replica's mid-round
ones. transformers is not needed to export a GPT, only to load it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from swarmgrad.node.runspec import RunSpec
from swarmgrad.node.state.checkpoint import Checkpoint, CheckpointError, candidates, read
from swarmgrad.node.training.data import TOKENIZER_TENSOR, load_corpus, tokenizer_of
from swarmgrad.node.training.hf import build_hf, save_hf
from swarmgrad.node.training.model import skeleton
from swarmgrad.node.training.shards import check_ids, load_tokenizer
from swarmgrad.protocol.errors import SetupError

LAYER_NORM_EPSILON = 1e-5  # torch's nn.LayerNorm default, which the GPT uses


class ExportError(SetupError):
    """The checkpoint cannot be exported (or the output folder is in the way); says why."""


def newest_checkpoint(path: Path) -> Checkpoint:
    """``path`` itself if it is a checkpoint, else the newest whole one in the folder ``path``."""
    if (path / "manifest.json").exists():
        try:
            return read(path)
        except CheckpointError as error:
            raise ExportError(str(error)) from None
    reasons = []
    for candidate in candidates(path):
        try:
            return read(candidate)
        except CheckpointError as error:
            reasons.append(str(error))
    why = "; ".join(reasons) or "it holds none"
    raise ExportError(f"no usable checkpoint in {path}: {why}")


def gpt2_tensors(model: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """The GPT's parameters (``embed.weight``, ``blocks.0.qkv.weight``, ...) under GPT-2's names."""
    out = {
        "transformer.wte.weight": model["embed.weight"],
        "transformer.wpe.weight": model["position.weight"],
        "transformer.ln_f.weight": model["norm.weight"],
        "transformer.ln_f.bias": model["norm.bias"],
    }
    linear = {"qkv": "attn.c_attn", "proj": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}
    norms = {"norm1": "ln_1", "norm2": "ln_2"}
    for i in range(n_layers):
        ours, theirs = f"blocks.{i}", f"transformer.h.{i}"
        for name, target in linear.items():
            out[f"{theirs}.{target}.weight"] = model[f"{ours}.{name}.weight"].T
            out[f"{theirs}.{target}.bias"] = model[f"{ours}.{name}.bias"]
        for name, target in norms.items():
            out[f"{theirs}.{target}.weight"] = model[f"{ours}.{name}.weight"]
            out[f"{theirs}.{target}.bias"] = model[f"{ours}.{name}.bias"]
    return {name: t.detach().float().contiguous().clone() for name, t in out.items()}


def _tokenizer(found: Checkpoint, cache_dir: Path) -> Tokenizer:
    """The tokenizer the checkpoint's replica trained with: kept in the checkpoint (the shards
    may have changed since, and a BPE trained on them again would differ), else (a checkpoint
    from before it was kept) the pinned ``data.tokenizer``, else the run's corpus again."""
    spec = found.spec
    if TOKENIZER_TENSOR in found.tensors:
        tokenizer = tokenizer_of(found.tensors[TOKENIZER_TENSOR])
        check_ids(tokenizer, spec.model.vocab_size, f"{found.path}: its tokenizer")
        return tokenizer
    if spec.data.source == "files" and spec.data.tokenizer:
        return load_tokenizer(spec.data, spec.model.vocab_size)
    return load_corpus(spec.data, vocab_size=spec.model.vocab_size, cache_dir=cache_dir).tokenizer


def export(checkpoint: Path, out_dir: Path, *, cache_dir: Path) -> Path:
    """Write ``checkpoint``'s model (a checkpoint, or a node's checkpoint folder: its newest) to
    ``out_dir`` as a Hugging Face directory; returns the checkpoint exported."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not an empty folder")
    found = newest_checkpoint(checkpoint)
    spec = found.spec
    model = {
        k.removeprefix("model."): v for k, v in found.tensors.items() if k.startswith("model.")
    }
    expected = {name: p.shape for name, p in skeleton(spec.model).named_parameters()}
    shapes = {name: t.shape for name, t in model.items()}
    if shapes != expected:
        raise ExportError(f"{found.path}: its model is not the run spec's {spec.model.kind}")
    tokenizer = _tokenizer(found, cache_dir)
    # Written into a sibling folder and renamed into place: a failed export leaves no half
    # directory behind (which a second try would refuse as "not an empty folder").
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        _write(found, model, tokenizer, partial)
        for path in partial.iterdir():  # whoever wrote it (safetensors, transformers): 0644
            path.chmod(0o644)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        partial.rename(out_dir)
    except OSError as error:
        raise ExportError(f"cannot write {out_dir}: {error.strerror or error}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return found.path


def _write(
    found: Checkpoint, model: dict[str, torch.Tensor], tokenizer: Tokenizer, out_dir: Path
) -> None:
    spec = found.spec
    metadata = {
        "run_id": spec.run.id,
        "spec_hash": spec.hash.hex(),
        "epoch": found.epoch,
        "checkpoint": found.path.name,
    }
    special = special_tokens(tokenizer)
    ids = {f"{role}_token_id": tokenizer.token_to_id(token) if token else None
           for role, token in special.items()}  # fmt: skip
    if spec.model.kind == "hf":
        hf = build_hf(spec.model, seed=0)
        with torch.no_grad():
            for name, parameter in hf.named_parameters():  # tied weights: named once
                parameter.copy_(model[name])
        for key, value in ids.items():
            setattr(hf.hf.config, key, value)
            setattr(hf.hf.generation_config, key, value)
        save_hf(hf, out_dir, metadata)
    else:
        _save_gpt2(spec, model, out_dir, {"swarmgrad": metadata, **ids})
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": spec.model.seq_len,
        "clean_up_tokenization_spaces": False,
    }
    tokenizer_config.update({f"{role}_token": token for role, token in special.items() if token})
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))


#: What a special token's text says of its role (GPT-2's ``<|endoftext|>`` ends and begins).
_ROLES = {
    "bos": ("<s>", "<bos>", "<|begin_of_text|>", "<|endoftext|>", "[CLS]"),
    "eos": ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "[SEP]"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
}


def special_tokens(tokenizer: Tokenizer) -> dict[str, str | None]:
    """The tokenizer's own begin, end and padding tokens (None where it has none: the demo's
    byte-level BPE has no special token at all, so transformers must not assume GPT-2's)."""
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    return {
        role: next((token for token in names if token in specials), None)
        for role, names in _ROLES.items()
    }


def _save_gpt2(
    spec: RunSpec, model: dict[str, torch.Tensor], out_dir: Path, extra: dict[str, Any]
) -> None:
    save_file(
        gpt2_tensors(model, spec.model.n_layers),
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    config: dict[str, Any] = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": spec.model.vocab_size,
        "n_positions": spec.model.seq_len,
        "n_embd": spec.model.d_model,
        "n_layer": spec.model.n_layers,
        "n_head": spec.model.n_heads,
        "n_inner": 4 * spec.model.d_model,
        "activation_function": "gelu",  # exact GELU, as F.gelu
        "layer_norm_epsilon": LAYER_NORM_EPSILON,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        **extra,  # the special tokens' ids, and the checkpoint's own description
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
