"""The pipeline GPT cut into stages: each stage is a module of its own layer span.

The pipeline's model is the demo GPT with an untied output head (a tied embedding would have to
live on the first and the last stage at once). Every parameter is initialized from a generator
seeded by the run's seed and the parameter's name in the whole model, so a stage server builds
its own span alone, and the stages chained in one process (:class:`Pipeline`) are the very
model the swarm trains: the reference for parity.

Stage 0 takes token ids ``(batch, seq)``; the others take activations ``(batch, seq, d_model)``.
The last stage ends with the final norm and the head, and computes the loss itself (the trainer
sends it the labels).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from swarmgrad.node.runspec import ModelSection, PipelineSection, RunSpec
from swarmgrad.node.training.model import Block
from swarmgrad.protocol.stage import StageSchema


class Stage(nn.Module):
    """Layers ``[start, end)`` of the pipeline GPT (with the embeddings on stage 0, and the final
    norm and head on the last stage)."""

    def __init__(
        self, config: ModelSection, span: tuple[int, int], *, first: bool, last: bool
    ) -> None:
        super().__init__()
        self.config, self.span, self.first, self.last = config, span, first, last
        if first:
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
            self.position = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.n_heads) for _ in range(span[1] - span[0])
        )
        if last:
            self.norm = nn.LayerNorm(config.d_model)
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (stage 0) or activations in; activations, or logits (last stage), out."""
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embed(x) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.norm(x))
        return x

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage: mean cross-entropy of the logits of ``x`` against ``targets``."""
        logits = self(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def global_name(self, name: str) -> str:
        """A parameter's name in the whole model (blocks numbered from layer 0)."""
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            return f"blocks.{self.span[0] + int(index)}.{rest}"
        return name


def build_stage(config: ModelSection, pipeline: PipelineSection, index: int, *, seed: int) -> Stage:
    """Stage ``index`` of the run's pipeline, with its initial weights."""
    spans = pipeline.spans(config.n_layers)
    if not 0 <= index < len(spans):
        raise ValueError(f"stage {index} is not one of the run's {len(spans)} stages")
    stage = Stage(config, spans[index], first=index == 0, last=index == len(spans) - 1)
    with torch.no_grad():
        for name, parameter in stage.named_parameters():
            _init(parameter, stage.global_name(name), config.n_layers, seed)
    return stage


def _init(parameter: torch.Tensor, name: str, n_layers: int, seed: int) -> None:
    """GPT-2's initialization, drawn from a generator of the seed and the parameter's name."""
    if name.endswith("bias"):
        parameter.zero_()
    elif parameter.dim() == 1:  # LayerNorm gains
        parameter.fill_(1.0)
    else:
        digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        std = 0.02
        if name.endswith(("proj.weight", "down.weight")):  # residual branches
            std /= math.sqrt(2 * n_layers)
        parameter.normal_(0.0, std, generator=generator)


class Pipeline(nn.Module):
    """Every stage chained in one process: the model a pipeline run trains, whole."""

    def __init__(self, config: ModelSection, pipeline: PipelineSection, *, seed: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList(
            build_stage(config, pipeline, k, seed=seed) for k in range(pipeline.stages)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for stage in self.stages:
            x = stage(x)
        return x

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = inputs
        for stage in self.stages[:-1]:
            x = stage(x)
        last = self.stages[-1]
        assert isinstance(last, Stage)
        return last.loss(x, targets)


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class GradientSum:
    """The sum of a module's per-microbatch gradients, exact whatever their order.

    Microbatches reach a stage replica in whatever order the network delivers them, and fp32
    addition is not associative: accumulated in ``.grad``, the same microbatches give slightly
    different gradients in another order, which training amplifies. Summed in fp64 (exact for
    the few terms of a batch) and rounded once to fp32 at the step, a batch's gradient is one
    number whatever the order: a pipeline trains bit-for-bit like its one-process reference.
    Costs an fp64 copy of the parameters' size.
    """

    def __init__(self, module: nn.Module) -> None:
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._sums = [torch.zeros_like(p, dtype=torch.float64) for p in self._params]

    def collect(self) -> None:
        """Add the gradients the last backward left in ``.grad``, and clear them."""
        for parameter, total in zip(self._params, self._sums, strict=True):
            if parameter.grad is not None:
                total.add_(parameter.grad)
                parameter.grad = None

    def release(self) -> None:
        """Put the sum in ``.grad`` (for the optimizer's step) and start a new one."""
        for parameter, total in zip(self._params, self._sums, strict=True):
            parameter.grad = total.to(parameter.dtype)
            total.zero_()


def schema_of(spec: RunSpec, index: int) -> StageSchema:
    """What stage ``index`` of ``spec``'s pipeline accepts."""
    pipeline, model = spec.pipeline, spec.model
    return StageSchema(
        run_id=spec.run.id,
        spec_hash=spec.hash,
        stage=index,
        stages=pipeline.stages,
        seq_len=model.seq_len,
        d_model=model.d_model,
        vocab_size=model.vocab_size,
        max_batch=spec.data.batch_size,
        activations=pipeline.activations,
        gradients=pipeline.gradients,
    )


def module_index(module: Stage, spec: RunSpec) -> int:
    """Which of ``spec``'s stages ``module`` is (by its span of layers)."""
    return spec.pipeline.spans(spec.model.n_layers).index(module.span)
