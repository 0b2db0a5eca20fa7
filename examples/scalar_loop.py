"""The seeds' scalar loop, run through looplm's recurrence engine.

s[r] = w * s[r-1] + e with e = 1, s[0] = 0, w = 0.5; four rounds; target 2; loss only after
round four. Full backpropagation gives dL/dw = -0.34375; cutting the gradient after round
two (a backward window of 2) keeps the forward value and gives -0.3125.

    python examples/scalar_loop.py
"""

import torch

import looplm


def scalar_gradient(backward_window: int | None) -> tuple[float, float, float]:
    w = torch.tensor(0.5, requires_grad=True)
    e = torch.tensor(1.0)
    run = looplm.unroll(lambda s, r: w * s + e, torch.tensor(0.0), rounds=4, backward_window=backward_window)
    loss = (run.state - 2) ** 2 / 2
    loss.backward()
    return run.state.item(), loss.item(), w.grad.item()


if __name__ == "__main__":
    for window in (None, 2):
        s4, loss, grad = scalar_gradient(window)
        label = "full backprop" if window is None else f"last {window} rounds"
        print(f"{label:15s} s[4] = {s4}  L = {loss}  dL/dw = {grad}")
