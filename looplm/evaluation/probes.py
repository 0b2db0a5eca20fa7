"""Linear probes on the loop state: after which round is a task variable linearly readable?

For each round r we take the state after round r at the last prompt position (where the
first answer token is predicted), fit a multinomial logistic
regression on half of the examples and score it on the other half. Targets:

- "answer": the first answer token (on chains: the digit the chain ends in);
- "hop" (chains only): the node reached after min(r, k) links from the queried name.
  If the model follows one link per round, this is readable at round r while the answer
  is not yet; probe accuracy by round shows where in depth the answer becomes readable.

The model's own readout at round r (the logit lens) is reported beside the probes by the
experiment; a probe can find information the head does not use yet.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import UserError
from ..data.tasks import Example
from ..data.taskdata import PROBE_SEED, TaskSource, encode_examples


def chain_path(prompt: str) -> list[str]:
    """[queried name, next name, ..., digit]: the links followed to answer a chain prompt."""
    *statements, question = prompt.split("; ")
    binding = dict(s.split("=", 1) for s in statements)
    node = question.removeprefix("? ")
    path = [node]
    while not node.isdigit():
        if node not in binding or len(path) > len(binding) + 1:
            raise UserError(f"chain prompt has no answer for {node!r}: {prompt!r}")
        node = binding[node]
        path.append(node)
    return path


def answer_target(ex: Example, r: int) -> str:
    return ex.answer[0]


def hop_target(ex: Example, r: int) -> str:
    path = chain_path(ex.prompt)
    return path[min(r, len(path) - 1)]


@torch.no_grad()
def collect_states(model: torch.nn.Module, tok: Any, examples: list[Example], rounds: int,
                   batch_size: int = 128, separator: bool = True) -> torch.Tensor:
    """(rounds, N, d) loop state after each round at each example's last prompt position."""
    model.eval()
    chunks = []
    for i in range(0, len(examples), batch_size):
        b = encode_examples(tok, examples[i:i + batch_size], model.cfg.context, separator)
        out = model(b.x.to(next(model.parameters()).device), rounds, collect_stats=True,
                    generator=torch.Generator().manual_seed(0))
        pos = torch.tensor(b.prompt_lens) - 1
        rows = torch.arange(len(pos))
        chunks.append(torch.stack([s[rows, pos] for s in out.round_states]))  # (R, B, d)
    return torch.cat(chunks, dim=1).float()


def fit_probe(x_train: torch.Tensor, y_train: list[str], x_test: torch.Tensor, y_test: list[str],
              l2: float = 1e-3, iters: int = 100) -> float:
    """Test accuracy of a multinomial logistic regression fitted with L-BFGS (features standardised)."""
    classes = sorted(set(y_train) | set(y_test))
    index = {c: i for i, c in enumerate(classes)}
    yt = torch.tensor([index[c] for c in y_train])
    ye = torch.tensor([index[c] for c in y_test])
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
    xt, xe = (x_train - mean) / std, (x_test - mean) / std
    with torch.enable_grad():
        w = torch.zeros(xt.shape[1], len(classes), requires_grad=True)
        b = torch.zeros(len(classes), requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(xt @ w + b, yt) + l2 * w.pow(2).sum()
            loss.backward()
            return loss

        opt.step(closure)
    with torch.no_grad():
        return float(((xe @ w + b).argmax(-1) == ye).float().mean())


def probe_by_round(states: torch.Tensor, examples: list[Example],
                   target: Callable[[Example, int], str]) -> dict[int, float]:
    """round -> held-out probe accuracy; the first half of the examples fits, the second half tests."""
    half = len(examples) // 2
    if half < 2:
        raise UserError("probes need at least 4 examples")
    out = {}
    for r in range(1, states.shape[0] + 1):
        labels = [target(ex, r) for ex in examples]
        out[r] = fit_probe(states[r - 1, :half], labels[:half], states[r - 1, half:], labels[half:])
    return out


def run_probes(model: torch.nn.Module, tok: Any, source: TaskSource, n: int, difficulties: list[int],
               rounds: int, separator: bool = True) -> dict[str, Any]:
    """{"answer": {difficulty: {round: accuracy}}, "hop": {...} (chains), "chance": {difficulty: majority}}."""
    targets: dict[str, Callable[[Example, int], str]] = {"answer": answer_target}
    if source.task == "chain":
        targets["hop"] = hop_target
    sets = source.eval_sets(n, seed=PROBE_SEED, levels=difficulties)
    result: dict[str, Any] = {name: {} for name in targets}
    result["chance"] = {}
    for d, examples in sets.items():
        states = collect_states(model, tok, examples, rounds, separator=separator)
        for name, fn in targets.items():
            result[name][d] = probe_by_round(states, examples, fn)
        test = [ex.answer[0] for ex in examples[len(examples) // 2:]]
        result["chance"][d] = max(test.count(c) for c in set(test)) / len(test)
    return result
