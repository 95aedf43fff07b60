"""``[model] kind = "hf"``: a transformers causal-LM architecture (Llama, Qwen2, GPT-2, Mistral)
built from the run spec's ``[model.config]``, with no download.

:class:`HFCausalLM` wraps the transformers model with the interface the trainer, replicas and
exports use (``forward(tokens) -> logits``, ``loss(inputs, targets)``). Its initial weights are
transformers' own initialization drawn from a CPU generator seeded with ``data.seed``, so every
peer with the same spec and the same transformers version starts from the same parameters (a
run whose peers may differ in version pins them with ``model.init``). transformers is imported
only when such a model is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swarmgrad.node.runspec import ModelSection
from swarmgrad.protocol.errors import SetupError


class HFModelError(SetupError, ValueError):
    """The ``[model.config]`` does not make a transformers model here; the message says why."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise HFModelError(
            f'model.kind = "hf" needs transformers ({error}); pip install "swarmgrad[hf]"'
        ) from None
    return transformers


def hf_config(section: ModelSection) -> Any:
    """The transformers config of ``section``: its ``[model.config]`` plus vocab_size and the
    context length from the section; unknown keys are refused."""
    transformers = _transformers()
    given = dict(section.config)
    model_type = given.pop("model_type")
    try:
        defaults = transformers.AutoConfig.for_model(model_type)
    except (KeyError, ValueError) as error:
        raise HFModelError(f"model.config.model_type {model_type!r}: {error}") from None
    known = set(defaults.to_dict())
    unknown = sorted(set(given) - known)
    if unknown:
        raise HFModelError(
            f"model.config: {', '.join(unknown)} not in transformers' {type(defaults).__name__}"
        )
    positions = "n_positions" if model_type == "gpt2" else "max_position_embeddings"
    given |= {"vocab_size": section.vocab_size, positions: section.seq_len, "use_cache": False}
    try:
        return transformers.AutoConfig.for_model(model_type, **given)
    except (TypeError, ValueError) as error:
        raise HFModelError(f"model.config: {error}") from None


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the run's model interface; the transformers model is
    ``self.hf`` (so its parameters are named ``hf.<transformers name>``)."""

    def __init__(self, section: ModelSection) -> None:
        super().__init__()
        self.config = section
        transformers = _transformers()
        self.hf = transformers.AutoModelForCausalLM.from_config(
            hf_config(section), attn_implementation="sdpa"
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, length, vocab)`` for token ids ``(batch, length)``."""
        logits: torch.Tensor = self.hf(input_ids=tokens).logits
        return logits

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_hf(section: ModelSection, *, seed: int) -> HFCausalLM:
    """transformers' initialization, drawn from the CPU generator seeded with ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return HFCausalLM(section)


def save_hf(model: HFCausalLM, out_dir: Path, metadata: dict[str, Any]) -> None:
    """transformers' own directory (config.json + model.safetensors), with ``metadata`` under
    ``swarmgrad`` in the config."""
    model.hf.save_pretrained(out_dir, safe_serialization=True)
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    config["swarmgrad"] = metadata
    path.write_text(json.dumps(config, indent=1))
