"""An LSTM language model: the classic recurrent baseline for the looped transformers.

The cell is written out by hand (rather than using torch.nn.LSTM) so its equations are on
the page and the weights have one simple layout:

    z = W @ [h, x] + b            W: (4H, H + D), b: (4H,), gate blocks in order f, i, g, o
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h' = sigmoid(o) * tanh(c')

The initial state is zero unless one is given. `copy_to_torch_lstm` builds a torch.nn.LSTM
with the same weights, which the tests use to check these equations against PyTorch.

`lstm_sequence` is the reference; `LSTMLM` trains and evaluates through PyTorch's fused LSTM kernel
(`fused_lstm_sequence`, the same function on the same parameters, about twice as fast on a CPU
core: the loop over T steps runs in C++), and `LSTMLM.fused = False` runs the reference instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.func import functional_call

from ..errors import UserError


def _cell(z: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate pre-activations z (B, 4H) and cell c (B, H) -> new (h, c), each (B, H)."""
    f, i, g, o = z.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


def lstm_step(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, W: torch.Tensor,
              b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step. x (B, D), h and c (B, H), W (4H, H + D), b (4H,) -> (h', c')."""
    z = torch.cat([h, x], dim=-1) @ W.T + b  # (B, 4H)
    return _cell(z, c)


def _check_shapes(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> int:
    if x.dim() != 3:
        raise ValueError(f"x must be (T, B, D), got shape {tuple(x.shape)}")
    if W.dim() != 2 or W.shape[0] % 4 != 0:
        raise ValueError(f"W must be (4H, H + D), got shape {tuple(W.shape)}")
    H, D = W.shape[0] // 4, x.shape[-1]
    if W.shape[1] != H + D:
        raise ValueError(f"W must be (4H, H + D) = ({4 * H}, {H + D}) for input size {D}, got {tuple(W.shape)}")
    if b.shape != (4 * H,):
        raise ValueError(f"b must be (4H,) = ({4 * H},), got {tuple(b.shape)}")
    return H


def lstm_sequence(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor,
                  state: tuple[torch.Tensor, torch.Tensor] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Run the LSTM over x (T, B, D).

    Returns hs (T, B, H) and cs (T, B, H), the hidden and cell state after every step, and
    the final (h, c), each (B, H). With T = 0, hs and cs are empty (0, B, H) and the final
    state is the initial one.
    """
    H = _check_shapes(x, W, b)
    T, B, _ = x.shape
    if state is None:
        h = x.new_zeros(B, H)
        c = x.new_zeros(B, H)
    else:
        h, c = state
        if h.shape != (B, H) or c.shape != (B, H):
            raise ValueError(f"state must be two (B, H) = ({B}, {H}) tensors, got {tuple(h.shape)}, {tuple(c.shape)}")
    # Same arithmetic as lstm_step, but the input half of the projection does not depend on
    # the recurrence, so it is done for all T steps in one matmul instead of T small ones.
    W_h, W_x = W[:, :H], W[:, H:]  # (4H, H), (4H, D)
    zx = x @ W_x.T + b  # (T, B, 4H)
    hs, cs = [], []
    for t in range(T):
        h, c = _cell(zx[t] + h @ W_h.T, c)
        hs.append(h)
        cs.append(c)
    if T == 0:
        empty = x.new_zeros(0, B, H)
        return empty, empty.clone(), (h, c)
    return torch.stack(hs), torch.stack(cs), (h, c)


def torch_layout(W: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our (W, b) as a one-layer torch.nn.LSTM's parameters, by name (differentiable: slices and a cat).
    torch orders the gate blocks i, f, g, o (ours: f, i, g, o), keeps the input and hidden weights apart
    (ours: one W acting on [h, x], hidden columns first), and has two biases that are simply added (all
    of b goes in bias_ih, bias_hh is zero)."""
    if W.dim() != 2 or W.shape[0] % 4 != 0 or W.shape[1] <= W.shape[0] // 4:
        raise ValueError(f"W must be (4H, H + D) with D >= 1, got shape {tuple(W.shape)}")
    H = W.shape[0] // 4
    if b.shape != (4 * H,):
        raise ValueError(f"b must be (4H,) = ({4 * H},), got {tuple(b.shape)}")
    f, i, g, o = (slice(k * H, (k + 1) * H) for k in range(4))
    W_t = torch.cat([W[i], W[f], W[g], W[o]])      # rows reordered to i, f, g, o
    b_t = torch.cat([b[i], b[f], b[g], b[o]])
    return {"weight_ih_l0": W_t[:, H:], "weight_hh_l0": W_t[:, :H], "bias_ih_l0": b_t,
            "bias_hh_l0": torch.zeros_like(b_t)}


_SHAPES: dict[tuple[int, int], nn.LSTM] = {}


def fused_lstm_sequence(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """hs (T, B, H) of lstm_sequence(x, W, b) from a zero state, computed by PyTorch's fused LSTM with
    our parameters put in its layout; gradients reach W and b."""
    H = _check_shapes(x, W, b)
    key = (x.shape[-1], H)
    if key not in _SHAPES:      # a parameterless shell: every tensor it uses is passed in below
        _SHAPES[key] = nn.LSTM(key[0], H, device="meta")
    hs, _ = functional_call(_SHAPES[key], torch_layout(W, b), (x,))
    return hs


class LSTMLM(nn.Module):
    """Token embedding -> one LSTM layer -> linear head over the vocabulary."""

    def __init__(self, vocab_size: int, d_embed: int, hidden: int):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("d_embed", d_embed), ("hidden", hidden)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"LSTMLM {name} must be a positive integer, got {value!r}")
        self.vocab_size, self.d_embed, self.hidden = vocab_size, d_embed, hidden
        self.embed = nn.Embedding(vocab_size, d_embed)
        # Same uniform(+-1/sqrt(H)) init as torch.nn.LSTM.
        bound = 1.0 / math.sqrt(hidden)
        self.W = nn.Parameter(torch.empty(4 * hidden, hidden + d_embed).uniform_(-bound, bound))
        self.b = nn.Parameter(torch.zeros(4 * hidden))
        # Forget-gate bias 1: the cell starts out remembering, which helps gradients reach
        # early tokens (Jozefowicz et al., 2015). Gate order is f, i, g, o, so f is block 0.
        with torch.no_grad():
            self.b[:hidden].fill_(1.0)
        self.head = nn.Linear(hidden, vocab_size)
        self.fused = True     # PyTorch's fused kernel; False: the reference lstm_sequence

    def forward(self, idx: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, V), or (N, V) at the N True positions of `at` (B, T)
        bool: a masked task loss reads those alone (as LoopedLM.forward's readout_at), and the head
        over the vocabulary is the costliest product of a small LSTM."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T), got shape {tuple(idx.shape)}")
        x = self.embed(idx).transpose(0, 1)  # (T, B, D): lstm_sequence is time-major
        hs = (fused_lstm_sequence(x, self.W, self.b) if self.fused and x.shape[0] > 0
              else lstm_sequence(x, self.W, self.b)[0]).transpose(0, 1)  # (B, T, H)
        if at is not None:
            if at.shape != idx.shape or at.dtype != torch.bool:
                raise ValueError(f"at must be a (B, T) bool mask like idx {tuple(idx.shape)}, got "
                                 f"{at.dtype} {tuple(at.shape)}")
            hs = hs[at]                      # (N, H)
        return self.head(hs)


def copy_to_torch_lstm(W: torch.Tensor, b: torch.Tensor) -> nn.LSTM:
    """A single-layer, time-major torch.nn.LSTM computing the same function as
    lstm_sequence(x, W, b), with copies of the weights in its layout (`torch_layout`)."""
    params = torch_layout(W.detach(), b.detach())
    H = W.shape[0] // 4
    lstm = nn.LSTM(input_size=W.shape[1] - H, hidden_size=H, num_layers=1, bias=True, batch_first=False,
                   device=W.device, dtype=W.dtype)
    with torch.no_grad():
        for name, value in params.items():
            getattr(lstm, name).copy_(value)
    return lstm
