"""Several processes, one run: DDP or FSDP2 around the model, and the collectives the training loop needs.
PyTorch's engines do the distributed work; this module only decides how kiln uses them. Reading torchrun's
environment and joining its process group is `kiln.pipeline.runtime`'s (every command that computes does it).

- Launch: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE. `kiln train` with `train.nproc_per_node > 1` and no
  such variables starts torchrun on itself, so the DVC command stays `kiln train`.
- Backend: NCCL on CUDA (one GPU per local rank), gloo on CPU.
- `train.parallel: ddp` replicates the model; `zero1` also shards AdamW's moments across ranks.
  `fsdp` shards parameters, gradients and optimizer state per transformer block with `fully_shard` and, in
  bf16/fp16, computes in that dtype through its mixed-precision policy while the fp32 master weights stay
  sharded.
- Gradient accumulation: every micro-step but the last skips the gradient reduction (DDP's `no_sync`, FSDP's
  `set_requires_gradient_sync(False)`), so an optimizer step costs one reduction whatever the accumulation.
- Rank 0 alone prints, logs and writes outputs; the other ranks' console is silenced.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from kiln.pipeline.progress import console
from kiln.pipeline.runtime import World


def spread(world: World, parallel: str) -> str:
    """How a run is spread, for its first line: " x 2 processes (fsdp)", or "" for one process."""
    return f" x {world.size} processes ({parallel})" if world.size > 1 else ""


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run `kiln <argv>` under torchrun with `nproc` processes on this machine; return its exit code (a failed
    rank's own, so a user error still exits 2)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The launcher parses only its own options: given kiln's too, argparse takes an abbreviation of one of its
    # options for that option (`kiln grpo --start` is refused as ambiguous with --start-method).
    args = parse_args(["--standalone", f"--nproc_per_node={nproc}", "-m", "kiln.pipeline.cli"])
    args.training_script_args = list(argv)
    console.print(f"train.nproc_per_node={nproc}: running torchrun --standalone --nproc_per_node={nproc} -m "
                  f"kiln.pipeline.cli {' '.join(argv)}", highlight=False)
    try:
        run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c > 0), 1)
    return 0


def shards(parallel: str) -> bool:
    """Whether `wrap` applies FSDP2 (in a process group, train.parallel fsdp)."""
    return dist.is_initialized() and parallel == "fsdp"


def wrap(model: torch.nn.Module, parallel: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model the loop trains: DDP around it, or FSDP2 applied to each block and then the root (which keeps
    the embeddings, final norm and the head they are tied to). Unchanged outside a process group."""
    if not dist.is_initialized():
        return model
    if parallel == "ddp":
        # Buffers are the constant RoPE tables: nothing to broadcast before every forward.
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       broadcast_buffers=False)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def frozen_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, bytes in all) of the parameters that do not train, such as QLoRA's NF4 codes:
    under FSDP a rank holds its shard of each."""
    from torch.distributed.tensor import DTensor

    mine = whole = 0
    for p in model.parameters():
        if not p.requires_grad:
            local = p.to_local() if isinstance(p, DTensor) else p
            mine += local.numel() * local.element_size()
            whole += p.numel() * p.element_size()
    return mine, whole


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose state dict has plain names (DDP prefixes them with `module.`)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank calls it; rank 0 gets the whole state dict on the CPU (gathered from the shards under FSDP)."""
    if not is_sharded(model):
        return unwrap(model).state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded(model: torch.nn.Module) -> bool:
    if not dist.is_initialized():  # FSDP needs a process group; one process need not import it
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, sync: bool):
    """Backward passes inside reduce gradients across ranks only when `sync` (the last micro-step)."""
    if isinstance(model, DistributedDataParallel) and not sync:
        with model.no_sync():
            yield
        return
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)
    yield


def mean(t: torch.Tensor) -> torch.Tensor:
    """The mean of `t` over ranks (in place); `t` itself for one process."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def total(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over ranks (in place); `t` itself for one process."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (FSDP's gradient norm is one), gathered if sharded."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
