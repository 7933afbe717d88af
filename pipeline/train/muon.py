"""Muon for the transformer blocks' matrices, AdamW for everything else (`train.optimizer: muon`).

Muon (Keller Jordan, 2024; modded-nanogpt, nanochat) keeps a momentum of each matrix's gradient and steps along
its orthogonalised direction: five Newton-Schulz iterations push every singular value of the (Nesterov) momentum
towards 1, so no direction of the update dominates. It is for 2-D weights inside the network; the token
embedding, the LM head, norms and biases stay on AdamW, as nanochat and modded-nanogpt split them.

The update is torch.optim.Muon's (the same Newton-Schulz coefficients, Nesterov momentum by lerp, decoupled weight
decay, the lr scaled by sqrt(max(1, rows / cols))), with two differences:
- the iterations run in fp32 (or float64, for the tests' reference) off a GPU: torch's run in bf16, which a CPU
  without bf16 instructions computes 26x slower (29-49 ms a 128 x 384 matrix against 1.1-2 ms on this 2-core
  EPYC); on a GPU they run in bf16 as torch's do;
- matrices of one shape are orthogonalised together in one batched matmul, and the momentum warms up from
  `momentum_start` to `momentum` over `momentum_warmup` steps (modded-nanogpt's 0.85 -> 0.95 over 300).

Under FSDP2 a matrix, its gradient and its momentum are DTensors sharded by rows. The momentum and the Nesterov
mix are elementwise, so each rank computes them on its own rows; the orthogonalisation needs the whole matrix, so
the Nesterov momentum is gathered (one all-gather per matrix), every rank orthogonalises every matrix, and each
keeps its own rows of the result for its shard. That is the same update as one process's, at the cost of each
rank doing all of the Newton-Schulz work: torchtitan's DistMuon and nanochat's split the matrices among the
ranks instead, which saves that compute at large scale, not measured here.

`Optimizers` puts the two optimizers behind the one interface the training loop, GradScaler and the checkpoints
use: one list of param_groups, one state_dict numbered as a single optimizer's would be; iterating it gives the
optimizers, as torch.distributed.checkpoint's state-dict functions take them.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's and Keller Jordan's quintic
NS_STEPS = 5
NS_EPS = 1e-7


def orthogonalize(updates: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Newton-Schulz on a batch of matrices (B, rows, cols): each one's singular values pushed towards 1 (to
    roughly 0.7-1.2: the quintic trades exactness for speed), its singular vectors kept."""
    a, b, c = NS_COEFFICIENTS
    x = updates.to(torch.bfloat16) if updates.is_cuda else updates.to(torch.promote_types(updates.dtype,
                                                                                        torch.float32))
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.mT
        # a x + (b gram + c gram^2) x in two fused multiply-adds: 22 % less time than five separate ops on a
        # 1-thread CPU at the DAG's shapes (the products are the same; the elementwise passes are saved)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).to(updates.dtype)


def lr_ratio(shape: torch.Size) -> float:
    """torch.optim.Muon's default ("original") lr adjustment: sqrt(max(1, rows / cols))."""
    return math.sqrt(max(1.0, shape[0] / shape[1]))


class Muon(torch.optim.Optimizer):
    """Muon on 2-D parameters only. Group keys: lr, momentum, momentum_start, momentum_warmup, weight_decay."""

    def __init__(self, params, lr: float, momentum: float, momentum_start: float, momentum_warmup: int,
                 weight_decay: float):
        super().__init__(params, {"lr": lr, "momentum": momentum, "momentum_start": momentum_start,
                                  "momentum_warmup": momentum_warmup, "weight_decay": weight_decay})
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon updates matrices only; got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            by_shape = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[tuple(p.shape)].append(p)
            for params in by_shape.values():
                self._step_shape(group, params)

    def _step_shape(self, group: dict, params: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
        done = states[0]["step"].item()  # every matrix of a group steps together
        warm = min(1.0, done / group["momentum_warmup"]) if group["momentum_warmup"] else 1.0
        momentum = group["momentum_start"] + warm * (group["momentum"] - group["momentum_start"])
        grads = [p.grad for p in params]
        buffers = [state["momentum_buffer"] for state in states]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        nesterov = [g.lerp(buf, momentum) for g, buf in zip(grads, buffers)]
        directions = list(orthogonalize(torch.stack([whole(n) for n in nesterov])).unbind(0))
        directions = [like(d, p) for d, p in zip(directions, params)]
        lr = group["lr"]
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_add_(params, directions, alpha=-lr * lr_ratio(params[0].shape))


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole matrix of a sharded DTensor (gathered from every rank), a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def like(update: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`update`, a whole matrix every rank holds, laid out as `param`: for a DTensor its placements, taken from the
    replicated whole by slicing locally (no communication)."""
    if not hasattr(param, "device_mesh"):
        return update
    from torch.distributed.tensor import DTensor, Replicate

    mesh = param.device_mesh
    return DTensor.from_local(update, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
        mesh, param.placements)


class Optimizers:
    """Several optimizers as one: the concatenation of their param_groups (the same dicts, so setting a group's lr
    sets it), one step and zero_grad, and one state_dict numbered across them in order, as one optimizer's is."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    def __iter__(self):
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure=None) -> None:
        for opt in self.optimizers:
            opt.step()


    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for opt in self.optimizers:
            own = opt.state_dict()
            state.update({number + offset: value for number, value in own["state"].items()})
            groups += [{**g, "params": [number + offset for number in g["params"]]} for g in own["param_groups"]]
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups, offset = list(state_dict["param_groups"]), 0
        for opt in self.optimizers:
            own, groups = groups[:len(opt.param_groups)], groups[len(opt.param_groups):]
            size = sum(len(g["params"]) for g in opt.param_groups)
            numbers = range(offset, offset + size)
            opt.load_state_dict({
                "state": {n - offset: v for n, v in state_dict["state"].items() if n in numbers},
                "param_groups": [{**g, "params": [n - offset for n in g["params"]]} for g in own]})
            offset += size


class ZeroOptimizers(Optimizers):
    """Optimizers of ZeroRedundancyOptimizers (train.zero1): their state is gathered on one rank to be saved."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        for opt in self.optimizers:
            opt.consolidate_state_dict(to=to)
