"""Error feedback: carry what a lossy codec dropped into the next message (delayed, not lost).

Over T steps the sum of what was sent equals the sum of the inputs minus the last residual, so
the accumulated error stays bounded by one residual instead of growing with T (Seide et al. 2014;
Karimireddy et al. 2019). One :class:`ErrorFeedback` serves one stream of same-shaped tensors
(one slice of one parameter vector); its residual is training state and is checkpointed.
"""

from __future__ import annotations

import torch

from swarmgrad.compression.base import Codec, Meta, decode
from swarmgrad.compression.buffers import flat_float32


class ErrorFeedback:
    """Wrap ``codec``: encode ``tensor + residual``; keep ``(tensor + residual) - decoded``.

    The message describes a float32 tensor whatever the input dtype: the compensated value is
    computed in float32.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residual: torch.Tensor | None = None

    @property
    def residual(self) -> torch.Tensor | None:
        return self._residual

    def encode(self, tensor: torch.Tensor) -> tuple[bytes, Meta]:
        compensated = flat_float32(tensor).clone()
        if self._residual is not None:
            if self._residual.numel() != compensated.numel():
                raise ValueError(
                    f"error feedback holds a residual of {self._residual.numel()} values, "
                    f"got a tensor of {compensated.numel()}; call reset() when the shape changes"
                )
            compensated += self._residual
        data, meta = self.codec.encode(compensated.view(tensor.shape))
        sent = decode(data, meta).reshape(-1).float()
        self._residual = compensated.sub_(sent)
        return data, meta

    def reset(self) -> None:
        self._residual = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self._residual is None else {"residual": self._residual.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        residual = state.get("residual")
        self._residual = None if residual is None else flat_float32(residual).clone()
