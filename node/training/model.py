"""The demo model: a small GPT-style decoder (pre-norm, causal attention, tied embeddings), and
the run's model of either kind (``build_model``; transformers architectures in ``hf.py``).

Its initial weights are a function of the run spec alone: a CPU generator seeded with
``data.seed``, or the file ``model.init`` names, checked against ``model.init_sha256`` and the
model's shapes. So every peer of a run starts from the same parameters without sending any.
Parameters are also viewed as one flat fp32 vector (``flatten`` / ``unflatten``): what DiLoCo
averages and checksums.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from swarmgrad.node.files import atomic_write, read_pinned
from swarmgrad.node.runspec import ModelSection
from swarmgrad.node.training.hf import HFCausalLM, build_hf
from swarmgrad.protocol.errors import SetupError


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        shape = (batch, length, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm2(x))))
        return out


class GPT(nn.Module):
    def __init__(self, config: ModelSection) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.n_heads) for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(config.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, length, vocab)`` for token ids ``(batch, length)``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.norm(x) @ self.embed.weight.T
        return logits

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class InitWeightsError(SetupError, ValueError):
    """The weights ``model.init`` names cannot start this run; the message says why."""


#: The run's model: the built-in GPT or a transformers architecture (``hf.py``); both give
#: ``forward(tokens) -> logits`` and ``loss(inputs, targets)``.
CausalLM = GPT | HFCausalLM


#: What initialising parameters calls: ``nn.init``'s functions and the tensor methods they (and
#: models' own init code) use. Each sets values in place and leaves a tensor's shape alone.
_SETS_VALUES = frozenset(
    {
        *(name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")),
        *("normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "bernoulli_", "erfinv_"),
        *("mul_", "add_", "sub_", "div_", "clamp_", "masked_fill_", "index_fill_"),
    }
)


class _ShapesOnly(TorchFunctionMode):
    """Setting values on meta tensors (what initialising parameters does) is skipped: there is
    nothing to set there, and some of it costs seconds the first time in a process (a meta
    tensor's ``normal_`` made torch import its compiler stack: 1.7 s of CPU before a node joined,
    where the preflight sizes a checkpoint, and in every model run)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _SETS_VALUES:
            # A method's self, or ``nn.init``'s tensor (passed by name).
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def skeleton(config: ModelSection) -> CausalLM:
    """The model's structure on the meta device: names and shapes, no memory, no values."""
    with torch.device("meta"), _ShapesOnly():
        return HFCausalLM(config) if config.kind == "hf" else GPT(config)


def parameter_count(config: ModelSection) -> int:
    """The model's size, counted on :func:`skeleton` (no memory, any size)."""
    return sum(p.numel() for p in skeleton(config).parameters())


def init_weights(config: ModelSection) -> dict[str, torch.Tensor]:
    """The tensors of ``model.init``, after checking its SHA-256 and every name and shape."""
    path = Path(config.init)
    data = read_pinned(
        path,
        config.init_sha256,
        key="model.init",
        what="the weights the run starts from",
        error=InitWeightsError,
    )
    try:
        tensors = safetensors.torch.load(data)
    except safetensors.SafetensorError as error:
        raise InitWeightsError(f"model.init: {path} is not a safetensors file: {error}") from None
    expected = {name: t.shape for name, t in skeleton(config).state_dict().items()}
    missing, extra = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or extra:
        raise InitWeightsError(
            f"model.init: {path} does not fit the [model] section: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    for name, shape in expected.items():
        tensor = tensors[name]
        if tensor.shape != shape or not tensor.is_floating_point():
            raise InitWeightsError(
                f"model.init: {name} is {tensor.dtype} {list(tensor.shape)} in {path}, the model "
                f"needs floating point {list(shape)}"
            )
        if not torch.isfinite(tensor).all():
            raise InitWeightsError(f"model.init: {name} in {path} holds NaN or Inf")
    return tensors


def save_weights(model: CausalLM, path: Path) -> str:
    """Write ``model``'s weights for ``model.init`` (atomically); returns their SHA-256 for
    ``init_sha256``."""
    data = safetensors.torch.save({k: v.contiguous() for k, v in model.state_dict().items()})
    atomic_write(path, data)
    return hashlib.sha256(data).hexdigest()


def build_model(config: ModelSection, *, seed: int) -> CausalLM:
    """The run's initial model: identical on every peer for the same spec."""
    if config.kind == "hf":
        hf = build_hf(config, seed=seed)
        if config.init:
            hf.load_state_dict(init_weights(config))
        return hf
    model = GPT(config)
    if config.init:
        model.load_state_dict(init_weights(config))
        return model
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
            elif parameter.dim() == 1:  # LayerNorm gains
                parameter.fill_(1.0)
            else:
                std = 0.02
                if name.endswith(("proj.weight", "down.weight")):  # residual branches (GPT-2)
                    std /= math.sqrt(2 * config.n_layers)
                parameter.normal_(0.0, std, generator=generator)
    return model


def flatten(parameters: list[nn.Parameter]) -> torch.Tensor:
    """All parameters as one new flat fp32 vector, on their device."""
    return torch.cat([p.detach().reshape(-1).float() for p in parameters])


def unflatten(vector: torch.Tensor, parameters: list[nn.Parameter]) -> None:
    """Copy ``vector`` (as made by :func:`flatten`) into ``parameters``, in place."""
    offset = 0
    with torch.no_grad():
        for p in parameters:
            n = p.numel()
            p.copy_(vector[offset : offset + n].view_as(p))
            offset += n
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} values, the parameters {offset}")
