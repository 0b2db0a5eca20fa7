"""Training across processes: torchrun's world, DDP or FSDP2 applied from outside the model, depth in lockstep.

`looplm train` under `torchrun --nproc-per-node N -m looplm train ...` runs one process per rank.
Everything here is PyTorch's own machinery (torch.distributed, DistributedDataParallel,
`fully_shard`); this module only decides how the looped model is wrapped and checks that every
rank runs the same computation:

- `init_world(recipe)`: the process group from torchrun's environment (gloo on CPU, nccl on
  CUDA, one GPU per local rank). `train.parallel = "none"` refuses more than one process.
- `parallelize(model, recipe, world)`: the model as the trainer calls it. DDP replicates it and
  all-reduces gradients once per step (a shared core's gradient is summed over its visits by
  autograd before DDP's hook sees it); `find_unused_parameters` is on because a truncated
  backward window, a readout before the window or Stage II leave parameters without gradient
  in some steps. FSDP2 makes each prelude block, each core block, each coda block and the rest
  (embedding, head, norms, gate) its own unit. Core and coda blocks run several times per
  forward, so they keep their gathered weights until backward (`reshard_after_forward=False`):
  one all-gather per forward instead of one per visit, at the cost of holding the whole core
  unsharded through the forward (docs/distributed.md states what that costs).
- `lockstep(world, values)`: all-gather the per-micro-batch decisions (forward rounds, backward
  window, feedback passes) and fail loudly when ranks disagree.
- `shard(world, n)`: the rows of a global batch of n that this rank computes.
- `checkpoint_core(model)`: activation checkpointing per core block (train.activation_checkpointing).

Batches are global: `train.batch_size` sequences per micro-batch over all ranks, split evenly,
so one recipe means the same experiment at any world size (and a run can resume at another).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UserError


@dataclass(frozen=True)
class World:
    """This process's place in the job: rank, size (processes), local_rank (on its node)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None
    """The process group's backend ("gloo" | "nccl"), None when no group was created."""
    owned: bool = False
    """This world's group was created by `init_world` (and is destroyed by `close_world`)."""

    @property
    def main(self) -> bool:
        """Rank 0 writes the run folder, the progress bar and the report."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


SINGLE = World()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world(parallel: str, device: torch.device) -> World:
    """The process group for `train.parallel` on `device`'s kind. Under torchrun the environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) names the world; `looplm train` alone with
    ddp/fsdp makes a world of one (the same code path, for tests and single-GPU FSDP)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if parallel == "none":
        if size > 1:
            raise UserError(f"launched on {size} processes but train.parallel = \"none\"; "
                            "pass --set train.parallel=ddp (or fsdp)")
        return SINGLE
    if dist.is_initialized():                     # a caller (a test, a notebook) made the group
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                     dist.get_backend(), owned=False)
    if "RANK" not in os.environ:                  # not under torchrun: a world of one
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    backend = "nccl" if device.type == "cuda" else "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, device_id=torch.device("cuda", local) if device.type == "cuda" else None)
    return World(dist.get_rank(), dist.get_world_size(), local, backend, owned=True)


def rank_device(device: torch.device, world: World) -> torch.device:
    """One accelerator per local rank; the CPU is shared."""
    if device.type == "cuda" and world.distributed:
        return torch.device("cuda", world.local_rank)
    return device


def close_world(world: World) -> None:
    if world.owned and dist.is_initialized():
        dist.destroy_process_group()


def shard(world: World, n: int, name: str = "train.batch_size") -> slice:
    """Rows [rank * n/size, (rank + 1) * n/size) of a global batch of n."""
    if n % world.size:
        raise UserError(f"{name} {n} is the global batch over all processes and must be divisible "
                        f"by the world size {world.size}")
    per = n // world.size
    return slice(world.rank * per, (world.rank + 1) * per)


def parallelize(model: nn.Module, parallel: str, world: World) -> nn.Module:
    """What the trainer calls for the forward pass: the model itself (none, fsdp: `fully_shard`
    wraps it in place) or its DDP wrapper. Apply after freezing (Stage II) and before building the
    optimizer (FSDP2 replaces the parameters with sharded DTensors)."""
    if parallel == "none":
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        dev = model.embed.weight.device
        return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                       find_unused_parameters=True)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model.prelude:
            fully_shard(block)
        for block in [*model.core, *model.coda]:
            fully_shard(block, reshard_after_forward=False)   # several visits per forward, one gather
        fully_shard(model)                                     # embedding, head, norms, gate
        return model
    raise ValueError(f"train.parallel {parallel!r}")


def checkpoint_core(model: nn.Module) -> None:
    """Activation checkpointing per core block (train.activation_checkpointing), from outside the model:
    each block's forward runs under `torch.utils.checkpoint` (non-reentrant) when gradients are on, so
    its activations are recomputed in the backward instead of stored. Rounds before the backward
    window (no_grad) run as before. Apply before `parallelize`, as torchtitan does."""
    from torch.utils.checkpoint import checkpoint
    for block in model.core:
        plain = block.forward

        def forward(*args: Any, _plain=plain, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, **kwargs)
        block.forward = forward


def no_sync(forward: nn.Module, parallel: str, last: bool) -> Any:
    """Context for one micro-batch's backward: gradients are reduced only on the step's last one."""
    import contextlib
    if parallel == "ddp" and not last:
        return forward.no_sync()
    if parallel == "fsdp":
        forward.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def all_sum(world: World, values: Sequence[float]) -> list[float]:
    """Element-wise sum over ranks (float64 on the CPU for gloo, the device for nccl)."""
    if not world.distributed:
        return list(values)
    dev = torch.device("cuda", world.local_rank) if world.backend == "nccl" else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return t.tolist()


def all_gather_ints(world: World, values: Sequence[int]) -> list[list[int]]:
    if not world.distributed:
        return [list(values)]
    dev = torch.device("cuda", world.local_rank) if world.backend == "nccl" else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.long, device=dev)
    out = [torch.empty_like(t) for _ in range(world.size)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


class LockstepError(RuntimeError):
    """Ranks drew different depths, windows or feedback passes for the same micro-batch."""


def lockstep(world: World, step: int, micro: int, rounds: int, window: int | None, passes: int = 1) -> None:
    """Every rank must run the same forward rounds, backward window and feedback passes for a
    micro-batch (else collectives pair different computations: FSDP gathers and reduces per module
    visit, and a pass visits every module). All-gathered and compared; raises on every rank."""
    mine = [step, micro, rounds, -1 if window is None else window, passes]
    seen = all_gather_ints(world, mine)
    if any(s != seen[0] for s in seen):
        table = "; ".join(f"rank {i}: rounds {s[2]}, window {'all' if s[3] < 0 else s[3]}, passes {s[4]}"
                          for i, s in enumerate(seen))
        raise LockstepError(f"step {step} micro-batch {micro}: ranks disagree on depth ({table}); "
                            "every rank must draw depth and feedback passes from the same (seed, step, micro-batch)")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's sharded parameter or a norm over one) gathered whole; other tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
