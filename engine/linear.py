"""Linear layers whose CPU fp32 path runs oneDNN on pre-packed weights.

MKL's sgemm repacks the weight on every call and is slow for the small row counts of a decode
step (measured here: 1.2-2x slower than oneDNN at 4-32 rows, and ~15% slower at prefill sizes).
oneDNN with a weight reordered once at load time is what vLLM's CPU backend relies on too.
Anywhere else (GPU, other dtypes, no oneDNN) the layer is a plain ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# A single row (decode at batch 1) is a pure weight stream where MKL's GEMV is as fast or
# faster; from two rows on, oneDNN's packed kernels win.
ONEDNN_MIN_ROWS = 2


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) plus an optional packed weight."""

    packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> bool:
        """Reorder the weight for oneDNN; returns whether the packed path is now used."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not onednn_available():
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed is not None and x.dtype == torch.float32 and x.dim() == 2
        if packed and x.shape[0] >= ONEDNN_MIN_ROWS:
            bias = None if self.bias is None else self.bias.detach()
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, bias, "none", [], ""
            )
        return F.linear(x, self.weight, self.bias)
