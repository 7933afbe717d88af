"""Quantized inference: a loaded model's linear layers quantized in place with TorchAO (`quantize_`).

What is quantized are the transformer blocks' linear layers (attention and MLP projections): the token
embedding, the LM head and the norms keep their precision, as vLLM's and TorchAO's recipes usually keep them,
since the head's errors land directly on every logit. The kinds:

- `int8`: int8 weights, one scale per output channel, activations as they are (weight-only), any device;
- `int4`: int4 weights in groups of 128 (weight-only), on a CUDA GPU (TorchAO's int4 kernels);
- `fp8`: fp8 (e4m3) weights and dynamically quantized activations, on a GPU of compute capability 8.9 or more.

The model's forward is unchanged otherwise, so the engine's paged attention and CUDA graphs work on it as on
the original.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from kiln.model.errors import UserError

KINDS = ("int8", "int4", "fp8")
FP8_DEVICES = "a CUDA GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell)"  # fp8 tensor cores


def runs_fp8(device: torch.device) -> bool:
    """Whether `device` has fp8 matmuls (torch._scaled_mm)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@contextlib.contextmanager
def quiet_torchao():
    """Import TorchAO without its messages: it says at import what its CUDA extensions cannot load on this
    machine, and torch warns about one of its enums; neither concerns a run that uses neither."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)


def check_quantize(kind: str | None, device: torch.device) -> None:
    """Refuse (UserError, one line) a kind that is not known or that `device` cannot run, before loading."""
    if kind is None:
        return
    if kind not in KINDS:
        raise UserError(f"--quantize {kind}: expected one of {', '.join(KINDS)}")
    device = torch.device(device)
    if kind == "int4" and device.type != "cuda":
        raise UserError(f"--quantize int4: TorchAO's int4 weight kernels need a CUDA GPU, not {device.type}; "
                        "int8 runs on any device")
    if kind == "fp8" and not runs_fp8(device):
        raise UserError(f"--quantize fp8: fp8 matmuls need {FP8_DEVICES}; this is {device.type}. int8 runs on any "
                        "device")


def quantize(model: torch.nn.Module, kind: str | None) -> torch.nn.Module:
    """`model` with its blocks' linear layers quantized as `kind` (in place; None: as it is)."""
    if kind is None:
        return model
    config = _config(kind)
    from torchao.quantization import quantize_

    quantize_(model.blocks, config, filter_fn=lambda module, _: isinstance(module, torch.nn.Linear))
    return model


def _config(kind: str):
    with quiet_torchao():
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            Int4WeightOnlyConfig,
            Int8WeightOnlyConfig,
        )
    return {"int8": Int8WeightOnlyConfig, "int4": lambda: Int4WeightOnlyConfig(group_size=128),
            "fp8": Float8DynamicActivationFloat8WeightConfig}[kind]()
