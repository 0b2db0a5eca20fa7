"""Recirculation's learned coefficients: how much of the source state to mix into the destination.

    conditional_vector   LayerNorm(2d) -> Linear(2d, d) -> GELU -> Linear(d, d) -> GELU -> Linear(d, 2d)
                         -> sigmoid: a feature-wise alpha and beta per token (about 5 d^2 matrix weights)
    conditional_scalar   the same network ending in Linear(d, 2): one alpha and beta per token
    constant_vector      alpha, beta in R^d, the same for every token (2 d weights)
    constant_scalar      one alpha and one beta (2 weights)

The four separate what adapting to the token buys from what extra parameters buy (the seeds'
ablations). Every kind starts at alpha = 0.1, beta = 0.9 (the output layer's weights zero, its bias
at those logits), so training starts from a fixed mix. alpha and beta are each bounded in [0, 1] by
the sigmoid, not tied to sum to one. The network reads [h_src; h_dst], the states the fixed mix reads
(inference/recirculation.py `mix` then matches the source's norm to the destination's).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch import Tensor, nn

KINDS = ("conditional_vector", "conditional_scalar", "constant_vector", "constant_scalar")
ALPHA0, BETA0 = 0.1, 0.9


class AdaptiveMixer(nn.Module):
    """(h_dst, h_src) (..., d) each -> (alpha, beta), each (..., d) or (..., 1); see the module docstring."""

    def __init__(self, d: int, kind: str = "conditional_vector"):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"mixer kind {kind!r}: expected one of {', '.join(KINDS)}")
        self.kind, self.d = kind, d
        width = d if kind.endswith("vector") else 1
        init = torch.tensor([math.log(ALPHA0 / (1 - ALPHA0)), math.log(BETA0 / (1 - BETA0))]).repeat_interleave(width)
        if kind.startswith("conditional"):
            self.net = nn.Sequential(nn.LayerNorm(2 * d), nn.Linear(2 * d, d), nn.GELU(), nn.Linear(d, d), nn.GELU(),
                                     nn.Linear(d, 2 * width))
            with torch.no_grad():
                self.net[-1].weight.zero_()
                self.net[-1].bias.copy_(init)
            self.logits = None
        else:
            self.net = None
            self.logits = nn.Parameter(init)                                    # (2 * width,)

    def forward(self, h_dst: Tensor, h_src: Tensor) -> tuple[Tensor, Tensor]:
        if self.net is not None:
            z = self.net(torch.cat([h_src, h_dst], dim=-1).float())            # (..., 2 * width)
        else:
            z = self.logits.float().expand(*h_dst.shape[:-1], -1)
        alpha, beta = torch.sigmoid(z).chunk(2, dim=-1)
        return alpha, beta

    def matrix_weights(self) -> int:
        """Weights in its matrices (the seeds' ~5 d^2 for conditional_vector): biases and norms left out."""
        return sum(p.numel() for p in self.parameters() if p.dim() == 2)


def save_mixer(mixer: AdaptiveMixer, path: Any, record: dict[str, Any] | None = None) -> None:
    """The mixer's weights as safetensors, its kind and width (and a training record) in the metadata."""
    from safetensors.torch import save_file
    meta = {"kind": mixer.kind, "d_model": str(mixer.d), "record": json.dumps(record or {})}
    save_file({k: v.detach().contiguous().cpu() for k, v in mixer.state_dict().items()}, str(path), metadata=meta)


def load_mixer(path: Any, d: int) -> AdaptiveMixer:
    """A mixer saved by `save_mixer` (safetensors: no pickles), checked against the model's width d: a
    damaged file, another program's, a mixer of another width or with other tensors is refused in one
    line naming the file (UserError)."""
    from ..errors import UserError
    from ..files import read_safetensors
    tensors, meta = read_safetensors(path)
    if meta.get("kind") not in KINDS or meta.get("d_model") != str(d):
        raise UserError(f"recirculation mixer {path}: kind {meta.get('kind')!r}, width {meta.get('d_model')}: not a "
                        f"mixer for this model (width {d})")
    mixer = AdaptiveMixer(d, meta["kind"])
    want = {k: tuple(v.shape) for k, v in mixer.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != want:
        wrong = sorted(set(want) ^ set(got)) or sorted(k for k in want if want[k] != got[k])
        raise UserError(f"recirculation mixer {path}: its tensors do not make a {meta['kind']} mixer of width {d} "
                        f"(missing, extra or misshapen: {', '.join(wrong[:3])})")
    mixer.load_state_dict(tensors)
    return mixer.eval()
