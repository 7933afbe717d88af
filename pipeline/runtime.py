"""Where and how a command computes: the device, its precision (autocast and TF32), kiln's kernels or torch's,
and this process's place in a torchrun job (which it joins). Training, post-training, evaluation, serving and
the CLI all take their device from here, so none of them reaches into the training loop for it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.kernels.backend import interpreting
from kiln.model.quantize import FP8_DEVICES, runs_fp8
from kiln.pipeline.errors import UserError
from kiln.pipeline.progress import console

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


SINGLE = World()


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets its variables)."""
    return "WORLD_SIZE" in os.environ


def from_env() -> World:
    """This process's place in a torchrun job, or SINGLE outside one."""
    if not launched():
        return SINGLE
    rank, local_rank, size = (int(os.environ.get(k, 0)) for k in ENV)
    return World(rank, local_rank, size)


def join(world: World, device: torch.device) -> torch.device:
    """Join the process group (a no-op for one process); return the device this rank trains on."""
    if world.size == 1:
        return device
    if device.type == "cuda":
        if world.local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {world.local_rank}: this machine has {torch.cuda.device_count()} GPUs; "
                            "start at most that many processes per node (train.nproc_per_node)")
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    if not world.main:
        console.quiet = True
    return device


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# each precision's compute dtype under autocast; fp8 runs the blocks' linear layers in fp8 (train/float8.py) and
# the rest in bf16
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"params: train.device={name!r}: CUDA is not available on this machine")
    return device


def autocast(device: torch.device, precision: str):
    """Mixed precision for the forward pass; fp32 runs without autocast (and with TF32 matmuls on CUDA)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=PRECISIONS[precision])


def setup_precision(device: torch.device, precision: str) -> None:
    """TF32 as the precision wants it; a device that cannot train in `precision` refused (one line)."""
    if precision == "fp8" and device.type != "cpu" and not runs_fp8(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise UserError(f"params: train.precision=fp8 needs {FP8_DEVICES}; this is {name}. bf16 trains here")
    if precision == "fp8" and device.type == "cpu":
        console.print("train.precision=fp8 on CPU: TorchAO emulates the fp8 matmuls (the same casts and scales, "
                      "not the speed: for tests)", highlight=False)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = precision == "fp32"
        torch.backends.cudnn.allow_tf32 = precision == "fp32"
    if device.type == "cpu" and precision != "fp32":
        console.print(f"warning: train.precision={precision} on CPU runs through slow autocast paths "
                      "(~14x slower than fp32 on a CPU without bf16 instructions, measured by kiln bench train)",
                      highlight=False)


def check_kernels(kernels: str, device: torch.device, where: str) -> None:
    """Refuse `triton` where the kernels cannot run, before a model is built rather than at its first forward."""
    if kernels == "triton" and device.type != "cuda" and not interpreting():
        raise UserError(f"{where}=triton: needs a CUDA device, or TRITON_INTERPRET=1 in the environment to run the "
                        "kernels in Triton's (slow) CPU interpreter")


# Whether kiln's kernels have measured faster than torch's in the compiled training step on a GPU, the way kiln
# trains there (kernels/BENCHMARKS.md). Until a GPU session shows it (`make gpu-check`, its first table),
# train.kernels=auto trains with torch's kernels on CUDA too; that session flips it.
KILN_KERNELS_FASTER_UNDER_COMPILE = False
AUTO_KERNELS_WHY = ("train.kernels=auto: torch's kernels (kiln's have not yet measured faster under torch.compile on "
                    "a GPU: kernels/BENCHMARKS.md)")


def resolve_kernels(kernels: str, device: torch.device) -> str:
    """The kernels a model on `device` runs for train.kernels `kernels`: `auto` becomes triton or torch here, so
    that the choice is made (and said) once rather than per op."""
    if kernels != "auto":
        return kernels
    if device.type == "cuda" and KILN_KERNELS_FASTER_UNDER_COMPILE:
        return "triton"
    if device.type == "cuda":
        _say_once(AUTO_KERNELS_WHY)
    return "torch"  # off CUDA auto never launched Triton


@functools.cache
def _say_once(message: str) -> None:
    """Print `message` the first time only: the scaling sweep prepares a device for each of its runs."""
    console.print(message, highlight=False, soft_wrap=True)


def prepare_device(params, world: World = SINGLE) -> torch.device:
    """The device a run trains on (this rank's GPU in a torchrun job, which it joins), with its precision
    settings made and its kernel choice checked; `params.kernels` auto is replaced by what it resolves to there
    (every stage builds its model with `params.kernels` after this)."""
    device = join(world, pick_device(params.device))
    setup_precision(device, params.precision)
    check_kernels(params.kernels, device, "params: train.kernels")
    params.kernels = resolve_kernels(params.kernels, device)
    return device
