"""``[model]``: the built-in GPT's sizes, or a transformers architecture; where it starts from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swarmgrad.node.runspec.errors import RunSpecError, positive

#: Model kinds: the built-in GPT, or a transformers causal-LM architecture built from a config.
MODEL_KINDS = ("gpt", "hf")
#: transformers families a run may name in ``model.config.model_type`` (others are untested).
HF_MODEL_TYPES = ("llama", "qwen2", "gpt2", "mistral")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSection:
    """The model: the built-in GPT-style decoder (``kind = "gpt"``, sized by d_model, n_layers
    and n_heads), or a transformers architecture (``kind = "hf"``) from the ``[model.config]``
    table (its ``model_type`` and that family's config keys; vocab_size and seq_len come from
    this section)."""

    kind: str = "gpt"
    #: kind = "hf": the transformers config, e.g. {model_type = "llama", hidden_size = 256, ...}.
    config: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 2048
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 128
    #: Start from these weights (a safetensors file; a relative path is read from the spec
    #: file's folder) instead of the seeded random ones: a pretrained or warmed-up model.
    init: str = ""
    #: The SHA-256 (hex) of the ``init`` file, required with it: the hash covers this, not the
    #: path, so peers keep the file wherever they like but all start from the same weights.
    init_sha256: str = ""

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")
        positive("model", **{k: getattr(self, k) for k in sizes})
        if bool(self.init) != bool(self.init_sha256):
            raise RunSpecError(
                "model.init and model.init_sha256 go together: the file to start from and its "
                "SHA-256 (sha256sum FILE), so every peer starts from the same weights"
            )
        if self.init_sha256 and not (
            len(self.init_sha256) == 64 and all(c in "0123456789abcdef" for c in self.init_sha256)
        ):
            raise RunSpecError(
                f"model.init_sha256 must be 64 lowercase hex digits, got {self.init_sha256!r}"
            )
        if self.kind not in MODEL_KINDS:
            raise RunSpecError(
                f"model.kind must be one of {', '.join(MODEL_KINDS)}, got {self.kind!r}"
            )
        if self.kind == "gpt" and self.config:
            raise RunSpecError('[model.config] is for kind = "hf" (a transformers architecture)')
        if self.kind == "hf":
            model_type = self.config.get("model_type")
            if model_type not in HF_MODEL_TYPES:
                raise RunSpecError(
                    f"model.config.model_type must be one of {', '.join(HF_MODEL_TYPES)}, got "
                    f"{model_type!r}"
                )
            for key in ("vocab_size", "max_position_embeddings", "n_positions"):
                if key in self.config:
                    raise RunSpecError(
                        f"model.config.{key}: set model.vocab_size / model.seq_len instead "
                        f"(the data uses them too)"
                    )
        if self.d_model % self.n_heads:
            raise RunSpecError(
                f"model.d_model ({self.d_model}) must be a multiple of model.n_heads "
                f"({self.n_heads})"
            )
